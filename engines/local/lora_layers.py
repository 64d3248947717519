"""LoRA adapters for the local engine: reading PEFT folders, and a linear layer that applies a
different adapter to each row of a batch.

Semantics per target linear layer, for each row ``i`` with adapter ``a(i)`` (or none):
``y[i] = x[i] @ W.T + ((x[i] @ A[a(i)].T) @ B[a(i)].T) * scaling[a(i)]`` — PEFT's LoRA forward.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn import functional as F

from core.errors import AdapterInvalid, AdapterRankTooLarge
from kernels.lora import (
    Gathered,
    LoRAStack,
    expand_gathered,
    gather,
    lora_expand,
    lora_shrink,
    shrink_gathered,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(TARGETS)
    + r")\.lora_([AB])\.weight$"
)
Slot = tuple[int, str]  # (layer index, projection name)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    rslora: bool
    targets: frozenset[str]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class LoRAWeights:
    name: str
    config: AdapterConfig
    pairs: dict[Slot, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.pairs.values()
        )


def read_adapter_config(folder: Path) -> AdapterConfig:
    """Parse and check ``adapter_config.json`` (cheap: no weights are read)."""
    try:
        raw: dict[str, Any] = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterInvalid(f"{folder}: no readable adapter_config.json ({exc})") from exc
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterInvalid(f"{folder}: only LoRA adapters are supported, not {raw['peft_type']}")
    for unsupported in ("use_dora", "modules_to_save"):
        if raw.get(unsupported):
            raise AdapterInvalid(f"{folder}: {unsupported} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterInvalid(f"{folder}: LoRA bias is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterInvalid(f"{folder}: r and lora_alpha must be positive numbers")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        targets = TARGETS if targets == "all-linear" else [targets]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise AdapterInvalid(f"{folder}: unsupported target modules {sorted(unknown)}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), frozenset(targets))


def check_rank(name: str, config: AdapterConfig, max_rank: int) -> None:
    if config.rank > max_rank:
        raise AdapterRankTooLarge(
            f"adapter {name} has rank {config.rank}; this engine serves ranks up to {max_rank}"
        )


def adapter_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype adapters are held and applied in, for a base model served in ``dtype``:
    float32 on the CPU, where a product as narrow as a LoRA rank ran 4-8 times slower in
    bfloat16 than in float32 (``bench/engine_profile.py``), and where PEFT keeps them in
    float32 too (``autocast_adapter_dtype``); the base model's dtype on CUDA."""
    return dtype if torch.device(device).type == "cuda" else torch.float32


def read_adapter(
    name: str,
    folder: Path,
    config: AdapterConfig,
    shapes: dict[Slot, tuple[int, int]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> LoRAWeights:
    """Load the weights and check every pair against the base model's (in, out) shapes."""
    path = folder / "adapter_model.safetensors"
    found: dict[Slot, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.match(key)
                if match is None:
                    raise AdapterInvalid(f"{path}: unexpected tensor {key}")
                slot = (int(match[1]), match[2])
                found.setdefault(slot, {})[match[3]] = tensors.get_tensor(key).to(dtype)
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
        raise AdapterInvalid(f"{path}: unreadable ({exc})") from exc
    pairs: dict[Slot, tuple[torch.Tensor, torch.Tensor]] = {}
    for slot, pair in found.items():
        if slot not in shapes or set(pair) != {"A", "B"}:
            raise AdapterInvalid(f"{path}: layer {slot} does not exist or lacks A or B")
        in_features, out_features = shapes[slot]
        a, b = pair["A"], pair["B"]
        if a.shape != (config.rank, in_features) or b.shape != (out_features, config.rank):
            raise AdapterInvalid(
                f"{path}: {slot} has shapes {tuple(a.shape)}, {tuple(b.shape)}; the base model "
                f"needs ({config.rank}, {in_features}), ({out_features}, {config.rank})"
            )
        pairs[slot] = (a.to(device).contiguous(), b.to(device).contiguous())
    if not pairs:
        raise AdapterInvalid(f"{path}: no LoRA weights")
    return LoRAWeights(name, config, pairs)


class BatchAdapters:
    """Which adapter each batch row uses, set by the engine before every forward pass.

    A uniform batch (every row on one adapter, or none) applies that adapter directly, exactly
    as PEFT does. A mixed decode step uses ``kernels.lora``'s gathered path: each slot's
    weights are gathered per row once per batch composition (it changes only when requests join
    or leave), so a step costs two batched matmuls per layer, not one pair per adapter. A mixed
    prompt pass (several tokens per row) groups its tokens by adapter instead (the segments
    path): it gathers nothing, and the decode batch's gather is kept across it.
    """

    def __init__(
        self, shapes: dict[Slot, tuple[int, int]] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.shapes = shapes or {}
        self.dtype = dtype  # the adapters' (``adapter_dtype``)
        self.uniform: LoRAWeights | None = None
        self.gathered: dict[Slot, Gathered] = {}
        self.segments: dict[Slot, tuple[LoRAStack, torch.Tensor]] = {}  # stack, adapter per token
        self._composition: list[LoRAWeights | None] = []
        self._kept: dict[Slot, Gathered] = {}

    def assign(self, per_row: list[LoRAWeights | None], steps: int = 1) -> None:
        """``per_row``'s adapters for a pass of ``steps`` tokens per row."""
        mixed = len({id(w) for w in per_row}) > 1
        self.uniform = None if mixed else per_row[0]
        self.gathered, self.segments = {}, {}
        if not mixed:
            return
        if steps > 1:
            self.segments = {
                slot: (stack, idx.repeat_interleave(steps))
                for slot, (stack, idx) in self._stacks(per_row).items()
            }
            return
        # Compared by identity: a name unloaded and loaded again is other weights.
        same = len(per_row) == len(self._composition) and all(
            a is b for a, b in zip(per_row, self._composition, strict=True)
        )
        if not same:
            self._composition = list(per_row)
            self._kept = {slot: gather(*pair) for slot, pair in self._stacks(per_row).items()}
        self.gathered = self._kept

    def _stacks(
        self, per_row: list[LoRAWeights | None]
    ) -> dict[Slot, tuple[LoRAStack, torch.Tensor]]:
        """Per slot, the stack of the adapters present and each row's index into it (-1: none)."""
        stacks = {}
        for slot in self.shapes:
            present = list(
                {w.name: w for w in per_row if w is not None and slot in w.pairs}.values()
            )
            if not present:
                continue
            stack = LoRAStack.of([(*w.pairs[slot], w.config.scaling) for w in present])
            position = {w.name: n for n, w in enumerate(present)}
            idx = torch.tensor(
                [-1 if w is None else position.get(w.name, -1) for w in per_row],
                device=stack.a.device,
            )
            stacks[slot] = (stack, idx)
        return stacks


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus, per batch row, that row's adapter (if it has one here)."""

    def __init__(self, base: nn.Linear, slot: Slot, batch: BatchAdapters) -> None:
        super().__init__()
        self.base = base
        self.slot = slot
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus each row's adapter delta, computed in the adapters'
        dtype (``adapter_dtype``) and rounded to the base layer's once, as PEFT adds it."""
        y: torch.Tensor = self.base(x)
        dtype = self.batch.dtype
        uniform = self.batch.uniform
        if uniform is not None:
            pair = uniform.pairs.get(self.slot)
            if pair is None:
                return y
            a, b = pair
            out = y.to(dtype) + F.linear(F.linear(x.to(dtype), a), b) * uniform.config.scaling
        elif (gathered := self.batch.gathered.get(self.slot)) is not None:
            out = expand_gathered(y.to(dtype), shrink_gathered(x.to(dtype), gathered), gathered)
        elif (segment := self.batch.segments.get(self.slot)) is not None:
            stack, idx = segment
            h = lora_shrink(x.to(dtype).reshape(-1, x.shape[-1]), stack, idx)
            out = lora_expand(y.to(dtype).reshape(-1, y.shape[-1]), h, stack, idx).view(y.shape)
        else:
            return y
        return out.to(y.dtype)


def install(model: nn.Module, batch: BatchAdapters) -> dict[Slot, tuple[int, int]]:
    """Wrap every target linear layer of a Llama-family model; records and returns each slot's
    (in_features, out_features)."""
    shapes: dict[Slot, tuple[int, int]] = {}
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr,arg-type]
        for parent in (layer.self_attn, layer.mlp):
            for proj in TARGETS:
                linear = getattr(parent, proj, None)
                if isinstance(linear, nn.Linear):
                    setattr(parent, proj, MultiLoRALinear(linear, (index, proj), batch))
                    shapes[(index, proj)] = (linear.in_features, linear.out_features)
    batch.shapes = shapes
    return shapes
