"""The recipe's losses: token negative log-likelihoods (the prompt prefix a batch, or a
training step, shares computed once), SFT cross-entropy, answer log-probabilities and DPO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
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
    per layer (``states``, in the graph) and what the rows read (``read``). For the parts of
    one training step (SFT, DPO, policy gradient) ``read`` is a detached copy, so each part's
    backward stops there and gathers its gradient on it; ``backward`` then sends the sum
    through the prefix's graph once, which gives the gradients of the summed loss."""

    length: int
    states: list[tuple[torch.Tensor, torch.Tensor]]
    read: list[tuple[torch.Tensor, torch.Tensor]]
    config: Any

    def cache(self, rows: int) -> DynamicCache:
        return DynamicCache(
            [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in self.read],
            config=self.config,
        )

    def backward(self) -> None:
        """Backpropagate what the parts gathered on ``read`` through the prefix."""
        pairs = [
            (state, leaf.grad)
            for states, leaves in zip(self.states, self.read, strict=True)
            for state, leaf in zip(states, leaves, strict=True)
            if leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])


def compute_prefix(model: Any, batch: Batch, *, detached: bool = False) -> Prefix | None:
    """The prefix every row of ``batch`` shares (``shared_prefix``), computed once; ``None``
    when the rows share too little. ``detached``: for parts that each run their backward (call
    ``Prefix.backward`` after the last)."""
    shared = shared_prefix(batch)
    if not shared:
        return None
    out = model(input_ids=batch.input_ids[:1, :shared], use_cache=True, logits_to_keep=1)
    states = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    read = states
    if detached:
        read = [
            (k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
            for k, v in states
        ]
    return Prefix(shared, states, read, model.config)


def token_nll(model: Any, batch: Batch, prefix: Prefix | None = None) -> torch.Tensor:
    """Negative log-likelihood of each label token given the tokens before it (0 where the
    label is ``IGNORE``), shape (batch, positions): the last ``positions`` label positions, from
    the first answer token of any row to the end (the positions before carry no loss).

    The prompt prefix the rows share (the specialist's system prompt and exemplars: about 190
    of the ~260 tokens of a GenUI example) is computed once, its keys and values read by every
    row: ``prefix`` when the caller computed it for more rows than ``batch`` (a training step's
    parts) and this batch's rows share no longer one, else this batch's own (one replayed row
    without the system prompt shortens the step's prefix, not the other parts'). Its tokens
    carry no loss, so the result is the full computation's (the same terms; gradients flow
    through the shared keys and values).

    The rows after the prefix are packed into one sequence without padding (``Packed``): each
    token attends to the prefix and to its own row's tokens before it, at its own position.
    Logits, a vocabulary wide per position, are computed only where a label follows."""
    if prefix is None or prefix.length < shared_prefix(batch):
        prefix = compute_prefix(model, batch)  # this batch's rows share more than the step's
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
    picked: torch.Tensor = F.cross_entropy(
        causal.lm_head(hidden[labelled]).float(), packed.targets[labelled], reduction="none"
    )
    rows, width = batch.input_ids.shape
    start = max(_first_label(batch) - 1, shared)
    grid = picked.new_zeros((rows, width - start - 1))
    return grid.index_put((packed.rows[labelled], packed.positions[labelled] - start), picked)


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


def sft_loss(model: Any, batch: Batch, prefix: Prefix | None = None) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of the whole batch."""
    targets = (batch.labels[:, 1:] != IGNORE).sum()
    return token_nll(model, batch, prefix).sum() / targets


def answer_logprobs(model: Any, batch: Batch, prefix: Prefix | None = None) -> torch.Tensor:
    """Summed log-probability of each row's answer, shape (batch,)."""
    return -token_nll(model, batch, prefix).sum(dim=1)


def answer_token_logprobs(
    model: Any, batch: Batch, prefix: Prefix | None = None
) -> list[torch.Tensor]:
    """Each row's log-probability of every answer token, in order."""
    nll = token_nll(model, batch, prefix)
    answer = batch.labels[:, batch.labels.shape[1] - nll.shape[1] :] != IGNORE
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
