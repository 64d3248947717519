"""The recipe's losses: token negative log-likelihoods (the prompt prefix a batch shares
computed once), and from them SFT cross-entropy, answer log-probabilities and DPO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from transformers import DynamicCache

from learners.recipes.tokens import IGNORE, Batch

SHARED_PREFIX_MIN = 16
"""Leading prompt tokens the rows of a batch must share before they are computed once."""


def shared_prefix(batch: Batch) -> int:
    """How many leading tokens every row of ``batch`` has in common before any row's answer
    begins (one short of it: the token the first answer token is predicted from stays in each
    row); 0 when that is fewer than ``SHARED_PREFIX_MIN`` or there is one row."""
    rows, width = batch.input_ids.shape
    if rows < 2:
        return 0
    answers = (batch.labels != IGNORE).int().argmax(dim=1)
    answers[(batch.labels == IGNORE).all(dim=1)] = width
    limit = int(answers.min()) - 1
    same = (batch.input_ids[:, :limit] == batch.input_ids[:1, :limit]).all(dim=0)
    differ = (~same).nonzero()
    shared = limit if len(differ) == 0 else int(differ[0, 0])
    return shared if shared >= SHARED_PREFIX_MIN else 0


@dataclass(frozen=True)
class Prefix:
    """The prompt prefix the rows share, computed once (one row's worth): its keys and values
    per layer, in the graph, so the rows' gradients flow back through it."""

    length: int
    states: list[tuple[torch.Tensor, torch.Tensor]]
    config: Any

    def cache(self, rows: int) -> DynamicCache:
        return DynamicCache(
            [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.states],
            config=self.config,
        )


def compute_prefix(model: Any, batch: Batch) -> Prefix | None:
    """The prefix every row of ``batch`` shares (``shared_prefix``), computed once; ``None``
    when the rows share too little."""
    shared = shared_prefix(batch)
    if not shared:
        return None
    decoder = model.get_base_model().model  # the prefix carries no loss: no output layer
    out = decoder(input_ids=batch.input_ids[:1, :shared], use_cache=True)
    states = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return Prefix(shared, states, model.config)


def token_nll(model: Any, batch: Batch) -> torch.Tensor:
    """Negative log-likelihood of each label token given the tokens before it (0 where the
    label is ``IGNORE``), shape (batch, positions): the last ``positions`` label positions, from
    the first answer token of any row to the end (the positions before carry no loss).

    The prompt prefix the rows share (the specialist's system prompt and exemplars: about 190
    of the ~260 tokens of a GenUI example, 477 of the ~520 of an agent one) is computed once,
    its keys and values read by every row. Its tokens carry no loss, so the result is the full
    computation's (the same terms; gradients flow through the shared keys and values).

    The rows after the prefix are packed into one sequence without padding (``Packed``): each
    token attends to the prefix and to its own row's tokens before it, at its own position.
    Logits, a vocabulary wide per position, are computed only where a label follows."""
    prefix = compute_prefix(model, batch)
    shared = prefix.length if prefix else 0
    packed = Packed.of(batch, shared)
    causal = model.get_base_model()  # the causal LM with the adapter's layers in it
    hidden = causal.model(
        input_ids=packed.ids[None],
        attention_mask=packed.mask(shared)[None, None],
        past_key_values=prefix.cache(1) if prefix else None,
        position_ids=packed.positions[None],
    ).last_hidden_state[0]
    labelled = (packed.targets != IGNORE).nonzero()[:, 0]
    picked = output_nll(hidden[labelled], causal.lm_head.weight, packed.targets[labelled])
    rows, width = batch.input_ids.shape
    start = max(_first_label(batch) - 1, shared)
    grid = picked.new_zeros((rows, width - start - 1))
    return grid.index_put((packed.rows[labelled], packed.positions[labelled] - start), picked)


class OutputNLL(torch.autograd.Function):
    """Each position's negative log-likelihood of its target through the frozen output layer
    (``hidden @ weight.T``, softmax in float32), with its gradient computed in the same pass.

    The gradient of a position's NLL to its logits is ``softmax - onehot(target)``, known as
    soon as the softmax is. So the forward pass turns it into the gradient to ``hidden`` there
    (``(softmax - onehot) @ weight``) and keeps only that, a hidden state wide per position,
    where autograd would keep the float32 log-softmax, a vocabulary wide (49,152 for SmolLM2),
    and pass over it three times more (the cast, the NLL's and the log-softmax's backward).
    The output layer is frozen (the adapters never train it): no gradient for ``weight``."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        if ctx.needs_input_grad[1]:
            raise ValueError("output_nll keeps no gradient for the output layer: it is frozen")
        logits = (hidden @ weight.T).float()
        rows = torch.arange(len(targets), device=targets.device)
        picked = logits[rows, targets]
        top = logits.amax(dim=-1, keepdim=True)
        probs = logits.sub_(top).exp_()  # in place: the logits are the one big tensor
        total = probs.sum(dim=-1)
        nll = total.log() + top[:, 0] - picked
        if ctx.needs_input_grad[0]:
            probs.div_(total[:, None])[rows, targets] -= 1.0
            ctx.save_for_backward(probs.to(weight.dtype) @ weight)
        return nll

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (to_hidden,) = ctx.saved_tensors
        return (to_hidden.float() * grad[:, None]).to(to_hidden.dtype), None, None


def output_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row of ``hidden``'s NLL of its target through the output layer ``weight``."""
    nll: torch.Tensor = OutputNLL.apply(hidden, weight, targets)  # type: ignore[no-untyped-call]
    return nll


@dataclass(frozen=True)
class Packed:
    """A batch's rows after their shared prefix, end to end in one sequence: each token's id,
    row, position in its row, and the label it predicts (the row's next token's; ``IGNORE``
    after a row's last token). Padding is left out."""

    ids: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, batch: Batch, shared: int) -> Packed:
        lengths = batch.attention_mask.sum(dim=1).tolist()
        device = batch.input_ids.device
        end = batch.labels.new_full((1,), IGNORE)
        return cls(
            ids=torch.cat([batch.input_ids[r, shared:n] for r, n in enumerate(lengths)]),
            rows=torch.cat(
                [torch.full((n - shared,), r, device=device) for r, n in enumerate(lengths)]
            ),
            positions=torch.cat([torch.arange(shared, n, device=device) for n in lengths]),
            targets=torch.cat(
                [torch.cat([batch.labels[r, shared + 1 : n], end]) for r, n in enumerate(lengths)]
            ),
        )

    def mask(self, shared: int) -> torch.Tensor:
        """Which keys each token attends to (True): the ``shared`` prefix, then the tokens of
        its own row up to itself."""
        own = (self.rows[:, None] == self.rows[None, :]) & (
            self.positions[None, :] <= self.positions[:, None]
        )
        return torch.cat([own.new_ones((len(self.ids), shared)), own], dim=1)


def _first_label(batch: Batch) -> int:
    """The first position of any row that has a label (the width when none has)."""
    labelled = batch.labels != IGNORE
    columns = labelled.any(dim=0).nonzero()
    return int(columns[0, 0]) if len(columns) else batch.labels.shape[1]


def sft_loss(nll: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of the rows ``nll`` (``token_nll``'s, of a
    batch with these ``labels``) holds."""
    return nll.sum() / (labels[:, 1:] != IGNORE).sum()


def answer_logprobs(nll: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's answer, shape (rows,)."""
    return -nll.sum(dim=1)


def answer_token_logprobs(nll: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Each row's log-probability of every answer token, in order."""
    answer = labels[:, labels.shape[1] - nll.shape[1] :] != IGNORE
    return [-row[mask] for row, mask in zip(nll, answer, strict=True)]


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Direct Preference Optimisation (Rafailov et al., 2023), mean over pairs:
    ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` on summed answer log-probs.
    It rewards raising the chosen answer relative to the reference more than the rejected one,
    so the policy cannot win by drifting everything away from the reference."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()
