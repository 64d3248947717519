"""The successor-adapter recipe's inputs: its hyperparameters (YAML, ``load_config``), the
examples it trains on, by kind, and what a run reports."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import ConfigError
from core.events import ChatMessage, ExperienceSource

DEFAULT_CONFIG = Path(__file__).with_name("lora-sft-dpo.yaml")
CPU_CONFIG = Path(__file__).with_name("lora-cpu.yaml")
"""Fewer, smaller steps and no DPO: what ``macaron demo`` trains with unless configured."""
RLOO_CONFIG = Path(__file__).with_name("lora-rloo.yaml")
"""The CPU recipe with policy gradient on rollout groups beside SFT."""


def _every_source() -> list[ExperienceSource]:
    return ["rollout", "feedback", "edit"]


class TrainingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(default=45, ge=1)
    batch_size: int = Field(default=8, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0.0)
    seed: int = Field(default=0, ge=0)
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the run trains: the CPU, or a CUDA GPU (``bench/gpu.sh``)."""
    precision: Literal["float32", "bfloat16", "auto"] = "float32"
    """The frozen base weights' dtype and the matrix products' (``bfloat16``: under autocast;
    the LoRA weights, the optimiser and the losses stay float32). ``bfloat16`` needs a device
    that runs it natively (else ``dtype_unsupported``); ``auto`` takes it where the device
    does, else float32."""
    max_length: int = Field(default=1024, ge=2)
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
    sources: list[ExperienceSource] = Field(default_factory=_every_source, min_length=1)
    """The records a run trains on and replays, by source (``core.events.ExperienceSource``):
    the model's own evidence alone is ``[rollout, feedback]``; an older record whose source is
    not known (a thumbs-up's or an edit's) is then left out too."""

    @property
    def own_evidence_only(self) -> bool:
        """Whether no answer someone else wrote is trained on (what self mode asks)."""
        return "edit" not in self.sources


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


class Examples(BaseModel):
    """What a run trains on, by kind: SFT examples, preference pairs, rollout groups, live
    samples, and the older SFT examples replayed beside them against forgetting."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sft: list[SFTExample] = []
    pairs: list[PreferencePair] = []
    groups: list[RolloutGroup] = []
    live: list[LiveSample] = []
    older: list[SFTExample] = []


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
    precision: Literal["float32", "bfloat16"] = "float32"
    """What the run computed in (``auto`` resolved on its machine)."""
