"""Successor-adapter recipe: train a specialist's next LoRA version from its parent.

One step is supervised fine-tuning on new experience (with a share of older experience replayed,
against forgetting) plus DPO on preference pairs, with the parent adapter as the DPO reference,
plus, where the config gives it a weight, policy gradient on rollout groups (RLOO advantages, a
clipped surrogate and a KL penalty to the parent: ``learners.recipes.policy``). Training starts
from the parent's weights, so a successor refines what its parent learned.

The file reads top to bottom as torchtune's recipes do: configuration and inputs, tokenising,
losses, then ``setup`` (model, data, optimiser), ``train`` (the steps) and ``save`` (the PEFT
folder the serving engine loads).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from peft import PeftModel
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.errors import ConfigError, NothingToTrain
from core.events import ChatMessage
from infra.artifacts import ADAPTER_FILES
from learners.recipes.policy import pg_loss, rloo_advantages

DEFAULT_CONFIG = Path(__file__).with_name("lora-sft-dpo.yaml")
CPU_CONFIG = Path(__file__).with_name("lora-cpu.yaml")
"""Fewer, smaller steps and no DPO: what ``macaron demo`` trains with unless configured."""
RLOO_CONFIG = Path(__file__).with_name("lora-rloo.yaml")
"""The CPU recipe with policy gradient on rollout groups beside SFT."""
ALIKE = 1e-9
"""An advantage this close to 0 is rounding of rewards that were alike (2/3 and 2/3)."""
IGNORE = -100  # label of a token that carries no loss (prompt and padding)
Progress = Callable[[int, int, dict[str, float]], None]

# --- configuration and inputs -----------------------------------------------------------------


class TrainingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=45, ge=1)
    batch_size: int = Field(default=8, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0.0)
    seed: int = Field(default=0, ge=0)
    max_length: int = Field(default=512, ge=2)
    dpo_beta: float = Field(default=0.1, gt=0.0)
    dpo_weight: float = Field(default=1.0, ge=0.0)
    replay_share: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Share of each SFT batch drawn from older experience, against forgetting."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    pg_weight: float = Field(default=0.0, ge=0.0)
    """Weight of the policy-gradient loss on rollout groups (0: groups are not trained on)."""
    pg_clip: float = Field(default=0.2, gt=0.0, lt=1.0)
    kl_beta: float = Field(default=0.04, ge=0.0)
    """Weight of the KL penalty to the parent in the policy-gradient loss."""


def load_config(path: Path = DEFAULT_CONFIG) -> TrainingConfig:
    """Hyperparameters from a YAML file; unknown keys are refused, not ignored."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read training config {path}: {exc}") from exc
    try:
        return TrainingConfig.model_validate(raw or {})
    except ValidationError as exc:
        raise ConfigError(f"invalid training config {path}: {exc}") from exc


class SFTExample(BaseModel):
    """A conversation and the answer the model should give next."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: list[ChatMessage]
    target: str


class PreferencePair(BaseModel):
    """A conversation and two answers, the first preferred over the second."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: list[ChatMessage]
    chosen: str
    rejected: str


class RolloutGroup(BaseModel):
    """A conversation, the answers the parent sampled for it and each one's reward."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: list[ChatMessage]
    answers: list[str] = Field(min_length=2)
    rewards: list[float] = Field(min_length=2)

    @model_validator(mode="after")
    def _a_reward_per_answer(self) -> RolloutGroup:
        if len(self.answers) != len(self.rewards):
            raise ValueError("a group needs exactly one reward per answer")
        return self


class LiveSample(BaseModel):
    """An answer the parent gave in live traffic and the reward it earned (a user's down or
    regenerate 0, an agent turn the share of its tool calls that worked). Each is its own
    context, so the baseline of its advantage is the other live samples' mean reward."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    messages: list[ChatMessage]
    answer: str
    reward: float = Field(ge=0.0, le=1.0)


class TrainingResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    steps: int
    final_loss: float
    losses: list[float]
    seconds: float
    examples: int
    pairs: int
    samples: int = 0
    """Rollout answers and live samples with a non-zero advantage, trained on by policy
    gradient."""


# --- tokenising -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tokenized:
    """Token ids of prompt + answer; ``labels`` is ``IGNORE`` except on the answer's tokens."""

    ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The tokens the chat template puts after an assistant answer, up to and including the
    token that stops generation (``<|im_end|>`` for SmolLM2): what the model must learn to
    emit when its answer is done. Anything the template adds after it (a newline) is never
    generated, so it is not learned either."""
    probe = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*probe, {"role": "assistant", "content": "y"}], tokenize=False
    )
    eos = tokenizer.eos_token_id
    if full.startswith(prompt + "y"):
        ids = list(tokenizer(full[len(prompt) + 1 :], add_special_tokens=False)["input_ids"])
        if eos in ids:
            return ids[: ids.index(eos) + 1]
    return [eos]  # a template that ends turns without the EOS token


def tokenize_turn(
    tokenizer: Any,
    messages: list[ChatMessage],
    answer: str,
    end_of_turn: list[int],
    max_length: int,
) -> Tokenized:
    """The prompt exactly as the engine builds it (chat template with the generation prompt),
    then the answer and the end of turn; loss falls on the answer and end of turn only.
    Too long a sequence loses its oldest context, keeping the answer that is being taught."""
    chat = [m.model_dump() for m in messages]
    prompt = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    target = [*tokenizer(answer, add_special_tokens=False)["input_ids"], *end_of_turn]
    ids = [*prompt, *target][-max_length:]
    labels = ([IGNORE] * len(prompt) + target)[-max_length:]
    return Tokenized(ids, labels)


def collate(items: list[Tokenized], pad_id: int) -> Batch:
    """Right-pad to the longest sequence; padding is masked out of attention and loss."""
    width = max(len(item.ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item.ids)] = torch.tensor(item.ids)
        labels[row, : len(item.labels)] = torch.tensor(item.labels)
        mask[row, : len(item.ids)] = 1
    return Batch(ids, mask, labels)


class Shuffled:
    """Endless shuffled passes over ``size`` items: every item is drawn once per pass, so a
    small dataset is covered evenly rather than by chance."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.rng = rng
        self.queue: list[int] = []

    def draw(self, n: int) -> list[int]:
        drawn: list[int] = []
        while len(drawn) < n:
            if not self.queue:
                self.queue = list(range(self.size))
                self.rng.shuffle(self.queue)
            drawn.append(self.queue.pop())
        return drawn


# --- losses -----------------------------------------------------------------------------------


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


def token_nll(model: Any, batch: Batch) -> torch.Tensor:
    """Negative log-likelihood of each label token given the tokens before it (0 where the
    label is ``IGNORE``), shape (batch, length - 1 - shared prefix).

    The prompt prefix the rows share (the specialist's system prompt and exemplars: about 400
    of the ~600 tokens of a GenUI example) is computed once, its keys and values repeated for
    every row; its tokens carry no loss, so the result is the full computation's (the same
    terms; gradients flow through the shared keys and values), with that prefix's positions
    left out."""
    shared = shared_prefix(batch)
    if shared:
        prefix = model(input_ids=batch.input_ids[:1, :shared], use_cache=True)
        cache = prefix.past_key_values
        cache.batch_repeat_interleave(batch.input_ids.shape[0])
        positions = torch.arange(shared, batch.input_ids.shape[1]).expand(
            batch.input_ids.shape[0], -1
        )
        logits = model(
            input_ids=batch.input_ids[:, shared:],
            attention_mask=batch.attention_mask,
            past_key_values=cache,
            position_ids=positions,
        ).logits
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    nll: torch.Tensor = F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(),
        batch.labels[:, shared + 1 :],
        ignore_index=IGNORE,
        reduction="none",
    )
    return nll


def sft_loss(model: Any, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of the whole batch."""
    targets = (batch.labels[:, 1:] != IGNORE).sum()
    return token_nll(model, batch).sum() / targets


def answer_logprobs(model: Any, batch: Batch) -> torch.Tensor:
    """Summed log-probability of each row's answer, shape (batch,)."""
    return -token_nll(model, batch).sum(dim=1)


def answer_token_logprobs(model: Any, batch: Batch) -> list[torch.Tensor]:
    """Each row's log-probability of every answer token, in order."""
    nll = token_nll(model, batch)
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


# --- setup ------------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything one training run holds: the model being trained, its optimiser, the
    tokenised data, and the parent's log-probs on each preference pair (the DPO reference)."""

    model: Any
    optimizer: torch.optim.Optimizer
    pad_id: int
    sft: list[Tokenized]
    older: list[Tokenized]
    pairs: list[tuple[Tokenized, Tokenized]]
    reference: torch.Tensor  # (pairs, 2): chosen, rejected
    samples: list[Tokenized]
    """Rollout answers with a non-zero advantage (policy gradient)."""
    advantages: torch.Tensor
    sample_reference: list[torch.Tensor]
    """The parent's token log-probabilities of each sample's answer."""


def load_model(base_model_dir: Path, parent_adapter_dir: Path) -> tuple[Any, Any]:
    """The frozen base model with the parent adapter on it, trainable: the successor starts
    from the parent's weights."""
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, parent_adapter_dir, is_trainable=True)
    return model, tokenizer


def reference_logprobs(
    model: Any, pairs: list[tuple[Tokenized, Tokenized]], pad_id: int, batch_size: int
) -> torch.Tensor:
    """Log-probs of every chosen and rejected answer under the parent, computed once before
    the first update so the reference needs no second copy of the model."""
    model.eval()
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            batch = collate([c for c, _ in chunk] + [r for _, r in chunk], pad_id)
            logps = answer_logprobs(model, batch)
            rows.append(torch.stack(logps.chunk(2), dim=1))
    return torch.cat(rows) if rows else torch.empty((0, 2))


def reference_token_logprobs(
    model: Any, samples: list[Tokenized], pad_id: int, batch_size: int
) -> list[torch.Tensor]:
    """Every sample's answer-token log-probabilities under the parent, before any update."""
    model.eval()
    found: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            batch = collate(samples[start : start + batch_size], pad_id)
            found += answer_token_logprobs(model, batch)
    return found


def group_samples(
    groups: list[RolloutGroup], live: list[LiveSample]
) -> list[tuple[list[ChatMessage], str, float]]:
    """Each answer of ``groups`` and ``live`` whose RLOO advantage is not 0, with its context
    and advantage: within a group over the group's other answers, for a live sample over the
    other live samples (answers that all scored alike teach nothing)."""
    sampled = [
        (group.messages, answer, advantage)
        for group in groups
        for answer, advantage in zip(group.answers, rloo_advantages(group.rewards), strict=True)
    ]
    advantages = rloo_advantages([s.reward for s in live])
    sampled += [(s.messages, s.answer, a) for s, a in zip(live, advantages, strict=True)]
    return [sample for sample in sampled if abs(sample[2]) > ALIKE]


def setup(
    base_model_dir: Path,
    parent_adapter_dir: Path,
    config: TrainingConfig,
    sft: list[SFTExample],
    preferences: list[PreferencePair],
    older: list[SFTExample],
    groups: list[RolloutGroup],
    live: list[LiveSample],
) -> Run:
    model, tokenizer = load_model(base_model_dir, parent_adapter_dir)
    end = end_of_turn_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end[-1]

    def turn(messages: list[ChatMessage], answer: str) -> Tokenized:
        return tokenize_turn(tokenizer, messages, answer, end, config.max_length)

    # With dpo_weight 0 the pairs would cost forward and backward passes and change nothing.
    used = preferences if config.dpo_weight > 0 else []
    pairs = [(turn(p.messages, p.chosen), turn(p.messages, p.rejected)) for p in used]
    reference = reference_logprobs(model, pairs, pad_id, config.batch_size)
    rolled = group_samples(groups, live) if config.pg_weight > 0 else []
    samples = [turn(messages, answer) for messages, answer, _ in rolled]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay
    )
    return Run(
        model=model,
        optimizer=optimizer,
        pad_id=pad_id,
        sft=[turn(e.messages, e.target) for e in sft],
        older=[turn(e.messages, e.target) for e in older],
        pairs=pairs,
        reference=reference,
        samples=samples,
        advantages=torch.tensor([advantage for _, _, advantage in rolled]),
        sample_reference=reference_token_logprobs(model, samples, pad_id, config.batch_size),
    )


# --- train ------------------------------------------------------------------------------------


def batch_shares(config: TrainingConfig, new: int, older: int) -> tuple[int, int]:
    """How many of each step's SFT examples come from new and from older experience, given
    how many of each there are: older experience is replayed only when there is some."""
    replayed = round(config.batch_size * config.replay_share) if older else 0
    return (config.batch_size - replayed if new else 0), replayed


def train_step(
    run: Run,
    config: TrainingConfig,
    sft_batch: list[Tokenized],
    pair_ids: list[int],
    sample_ids: list[int],
) -> dict[str, float]:
    """One optimiser step on the SFT batch, the preference pairs and the rollout samples;
    returns the losses."""
    run.optimizer.zero_grad(set_to_none=True)
    sft = sft_loss(run.model, collate(sft_batch, run.pad_id)) if sft_batch else torch.zeros(())
    dpo = torch.zeros(())
    if pair_ids:
        pairs = [run.pairs[i] for i in pair_ids]
        logps = answer_logprobs(
            run.model, collate([c for c, _ in pairs] + [r for _, r in pairs], run.pad_id)
        )
        chosen, rejected = logps.chunk(2)
        reference = run.reference[pair_ids]
        dpo = dpo_loss(chosen, rejected, reference[:, 0], reference[:, 1], config.dpo_beta)
    pg = torch.zeros(())
    if sample_ids:
        policy = answer_token_logprobs(
            run.model, collate([run.samples[i] for i in sample_ids], run.pad_id)
        )
        parent = [run.sample_reference[i] for i in sample_ids]
        advantages = run.advantages[sample_ids]
        pg = pg_loss(policy, parent, advantages, config.pg_clip, config.kl_beta)
    loss = sft + config.dpo_weight * dpo + config.pg_weight * pg
    loss.backward()
    run.optimizer.step()
    return {
        "loss": loss.item(),
        "sft_loss": sft.item(),
        "dpo_loss": dpo.item(),
        "pg_loss": pg.item(),
    }


def train(run: Run, config: TrainingConfig, progress: Progress | None) -> list[float]:
    """``config.steps`` steps; batches are drawn by a generator seeded from the config, so the
    same inputs and seed give the same updates."""
    rng = random.Random(config.seed)  # noqa: S311 (batch order, not secrets)
    new_items, older_items = Shuffled(len(run.sft), rng), Shuffled(len(run.older), rng)
    pair_items = Shuffled(len(run.pairs), rng)
    sample_items = Shuffled(len(run.samples), rng)
    new, older = batch_shares(config, len(run.sft), len(run.older))
    pairs_per_step = config.batch_size if run.pairs else 0
    samples_per_step = config.batch_size if run.samples else 0
    losses: list[float] = []
    run.model.train()
    for step in range(1, config.steps + 1):
        batch = [run.sft[i] for i in new_items.draw(new)]
        batch += [run.older[i] for i in older_items.draw(older)]
        metrics = train_step(
            run, config, batch, pair_items.draw(pairs_per_step), sample_items.draw(samples_per_step)
        )
        losses.append(metrics["loss"])
        if progress is not None:
            progress(step, config.steps, metrics)
    return losses


# --- save -------------------------------------------------------------------------------------


def save(model: Any, out_dir: Path) -> None:
    """Write exactly the PEFT adapter files the serving engine and the artifact store read.
    PEFT writes a list of target modules in set order, which changes between processes; it is
    sorted here so the same weights always give the same bytes (and content address). The
    embedding layers are never saved: the recipe does not train or resize them, and PEFT's
    check for a resized vocabulary would otherwise look the base model up on the Hub."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".saving-", dir=out_dir) as tmp:
        model.save_pretrained(tmp, save_embedding_layers=False)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
        if isinstance(config.get("target_modules"), list):
            config["target_modules"] = sorted(config["target_modules"])
        (Path(tmp) / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name in ADAPTER_FILES:
            shutil.move(Path(tmp) / name, out_dir / name)


def train_successor_adapter(
    base_model_dir: Path,
    parent_adapter_dir: Path,
    out_dir: Path,
    *,
    sft: list[SFTExample],
    preferences: list[PreferencePair],
    older: list[SFTExample],
    config: TrainingConfig,
    groups: list[RolloutGroup] | None = None,
    live: list[LiveSample] | None = None,
    progress: Progress | None = None,
) -> TrainingResult:
    """Train the successor of the adapter in ``parent_adapter_dir`` and write it to
    ``out_dir`` in PEFT format (``adapter_config.json`` and ``adapter_model.safetensors``)."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    run = setup(
        base_model_dir,
        parent_adapter_dir,
        config,
        sft,
        preferences,
        older,
        groups or [],
        live or [],
    )
    if not run.sft and not run.pairs and not run.samples:
        raise NothingToTrain(
            "a successor adapter needs SFT examples, or preference pairs, rollout groups or "
            "live rewards with a weight in the config and something to learn (answers that "
            "scored apart)"
        )
    losses = train(run, config, progress)
    save(run.model, out_dir)
    return TrainingResult(
        steps=config.steps,
        final_loss=losses[-1],
        losses=losses,
        seconds=time.perf_counter() - started,
        examples=len(sft),
        pairs=len(run.pairs),
        samples=len(run.samples),
    )
