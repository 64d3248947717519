"""Successor-adapter recipe: train a specialist's next LoRA version from its parent.

One step is supervised fine-tuning on new experience (with a share of older experience replayed,
against forgetting) plus DPO on preference pairs, with the parent adapter as the DPO reference,
plus, where the config gives it a weight, policy gradient on rollout groups (RLOO advantages, a
clipped surrogate and a KL penalty to the parent: ``learners.recipes.policy``). Training starts
from the parent's weights, so a successor refines what its parent learned.

The file reads top to bottom as torchtune's recipes do: ``setup`` (model, data, optimiser),
``train`` (the steps) and ``save`` (the PEFT folder the serving engine loads); its inputs are
``learners.recipes.config``'s, its tokenising ``learners.recipes.tokens``' and its losses
``learners.recipes.losses``'.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.errors import ConfigError, NothingToTrain
from core.events import ChatMessage
from infra.artifacts import ADAPTER_FILES
from infra.hardware import has_native_bf16, native_dtype
from learners.recipes.config import (
    Examples,
    LiveSample,
    RolloutGroup,
    TrainingConfig,
    TrainingResult,
)
from learners.recipes.fused import fuse_lora_layers
from learners.recipes.losses import (
    answer_logprobs,
    answer_token_logprobs,
    dpo_loss,
    sft_loss,
    token_nll,
)
from learners.recipes.policy import pg_loss, rloo_advantages
from learners.recipes.tokens import Shuffled, Tokenized, collate, end_of_turn_ids, tokenize_turn

ALIKE = 1e-9
"""An advantage this close to 0 is rounding of rewards that were alike (2/3 and 2/3)."""
Progress = Callable[[int, int, dict[str, float]], None]

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
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def autocast(self) -> AbstractContextManager[Any]:
        """Where the forward passes run: under bf16 autocast when the run computes in bf16."""
        return compute_in(self.device, self.dtype)


def compute_in(device: str, dtype: torch.dtype) -> AbstractContextManager[Any]:
    """Matrix products in ``dtype`` (autocast) when it is bfloat16; nothing changes else."""
    return torch.autocast(device, dtype=dtype, enabled=dtype == torch.bfloat16)


def run_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype ``config.precision`` stands for on ``config.device``."""
    if config.precision == "auto":
        return torch.bfloat16 if has_native_bf16(config.device) else torch.float32
    return native_dtype(config.precision, config.device)


def load_model(
    base_model_dir: Path,
    parent_adapter_dir: Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """The frozen base model in ``dtype`` with the parent adapter on it, trainable and float32
    (PEFT upcasts it), on ``device``: the successor starts from the parent's weights. A bf16
    model runs under autocast (``compute_in``): its activations meet the float32 adapter."""
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    base: Any = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=dtype)
    base.to(device)
    model = PeftModel.from_pretrained(
        base, parent_adapter_dir, is_trainable=True, autocast_adapter_dtype=True
    )
    fuse_lora_layers(model)
    return model, tokenizer


def reference_logprobs(
    model: Any,
    pairs: list[tuple[Tokenized, Tokenized]],
    pad_id: int,
    batch_size: int,
    device: str = "cpu",
) -> torch.Tensor:
    """Log-probs of every chosen and rejected answer under the parent, computed once before
    the first update so the reference needs no second copy of the model."""
    model.eval()
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            batch = collate([c for c, _ in chunk] + [r for _, r in chunk], pad_id, device)
            logps = answer_logprobs(token_nll(model, batch))
            rows.append(torch.stack(logps.chunk(2), dim=1))
    return torch.cat(rows) if rows else torch.empty((0, 2), device=device)


def reference_token_logprobs(
    model: Any, samples: list[Tokenized], pad_id: int, batch_size: int, device: str = "cpu"
) -> list[torch.Tensor]:
    """Every sample's answer-token log-probabilities under the parent, before any update."""
    model.eval()
    found: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            batch = collate(samples[start : start + batch_size], pad_id, device)
            found += answer_token_logprobs(token_nll(model, batch), batch.labels)
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
    base_model_dir: Path, parent_adapter_dir: Path, config: TrainingConfig, examples: Examples
) -> Run:
    device, dtype = config.device, run_dtype(config)
    model, tokenizer = load_model(base_model_dir, parent_adapter_dir, device, dtype)
    end = end_of_turn_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end[-1]

    def turn(messages: list[ChatMessage], answer: str) -> Tokenized:
        return tokenize_turn(tokenizer, messages, answer, end, config.max_length)

    # With dpo_weight 0 the pairs would cost forward and backward passes and change nothing.
    used = examples.pairs if config.dpo_weight > 0 else []
    pairs = [(turn(p.messages, p.chosen), turn(p.messages, p.rejected)) for p in used]
    rolled = group_samples(examples.groups, examples.live) if config.pg_weight > 0 else []
    samples = [turn(messages, answer) for messages, answer, _ in rolled]
    with compute_in(device, dtype):
        reference = reference_logprobs(model, pairs, pad_id, config.batch_size, device)
        sample_reference = reference_token_logprobs(
            model, samples, pad_id, config.batch_size, device
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(  # fused: one kernel over all the tensors, not a pass each
        trainable, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
    )
    return Run(
        model=model,
        optimizer=optimizer,
        pad_id=pad_id,
        sft=[turn(e.messages, e.target) for e in examples.sft],
        older=[turn(e.messages, e.target) for e in examples.older],
        pairs=pairs,
        reference=reference,
        samples=samples,
        advantages=torch.tensor([advantage for _, _, advantage in rolled], device=device),
        sample_reference=sample_reference,
        device=device,
        dtype=dtype,
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
    pairs = [run.pairs[i] for i in pair_ids]
    paired = [c for c, _ in pairs] + [r for _, r in pairs]
    samples = [run.samples[i] for i in sample_ids]
    # All the step's rows go through the model together, in one forward and one backward
    # pass: the prompt prefix they share (the specialist's system prompt) is computed once,
    # and each layer runs once on the rows packed after it, not once per part.
    batch = collate(sft_batch + paired + samples, run.pad_id, run.device)
    with run.autocast():
        nll = token_nll(run.model, batch)
    sizes = [len(sft_batch), len(paired), len(samples)]
    (sft_nll, pair_nll, sample_nll) = nll.split(sizes)
    (sft_labels, _, sample_labels) = batch.labels.split(sizes)
    zero = nll.new_zeros(())
    sft = sft_loss(sft_nll, sft_labels) if sft_batch else zero
    dpo = zero
    if pairs:
        chosen, rejected = answer_logprobs(pair_nll).chunk(2)
        reference = run.reference[pair_ids]
        dpo = dpo_loss(chosen, rejected, reference[:, 0], reference[:, 1], config.dpo_beta)
    pg = zero
    if samples:
        pg = pg_loss(
            answer_token_logprobs(sample_nll, sample_labels),
            [run.sample_reference[i] for i in sample_ids],
            run.advantages[sample_ids],
            config.pg_clip,
            config.kl_beta,
        )
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
    examples: Examples,
    config: TrainingConfig,
    progress: Progress | None = None,
) -> TrainingResult:
    """Train the successor of the adapter in ``parent_adapter_dir`` and write it to
    ``out_dir`` in PEFT format (``adapter_config.json`` and ``adapter_model.safetensors``)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("the training config asks for device cuda; this machine has no CUDA")
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    run = setup(base_model_dir, parent_adapter_dir, config, examples)
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
        examples=len(examples.sft),
        pairs=len(run.pairs),
        samples=len(run.samples),
        precision="bfloat16" if run.dtype == torch.bfloat16 else "float32",
    )
