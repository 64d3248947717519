"""Multi-LoRA ops for batches whose tokens use different adapters.

Semantics (the specification is ``shrink_reference`` / ``expand_reference``), for every token i:

    y[i] += (x[i] @ A[idx[i]].T) @ B[idx[i]].T * scale[idx[i]]      (idx[i] == -1: unchanged)

split as ``h = lora_shrink(x, A, idx)`` and ``y = lora_expand(y, h, B, scale, idx)``. Adapters of
one layer are stacked (``LoRAStack``), zero-padded to the largest rank: padding adds exactly 0.

Fast CPU paths, measured in ``bench/kernels.py``:
- *segments*: group tokens by adapter, pad the groups to the longest, and run one batched
  matmul over them. Best when each adapter has many tokens (prefill, long batches); a very
  uneven batch pays for the padding.
- *gathered*: gather each token's weights once (``gather``), then two batched matmuls. Best when
  each adapter has few tokens (decode steps); the local engine keeps the gather for as long as
  its batch composition holds.
The Triton kernel (``kernels/lora_triton.py``) is imported only where CUDA is present, or
``TRITON_INTERPRET=1`` is set to check it on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAStack:
    """One layer's adapters: ``a`` (N, r, in), ``b`` (N, out, r), ``scale`` (N,)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def of(pairs: list[tuple[torch.Tensor, torch.Tensor, float]]) -> LoRAStack:
        """Stack (A (r, in), B (out, r), scale) per adapter, zero-padding to the largest rank,
        on the device and in the dtype of the first adapter."""
        if not pairs:
            raise ValueError("a LoRA stack needs at least one adapter")
        rank = max(a.shape[0] for a, _, _ in pairs)
        fan_in, fan_out = pairs[0][0].shape[1], pairs[0][1].shape[0]
        dtype, device = pairs[0][0].dtype, pairs[0][0].device
        a_all = torch.zeros(len(pairs), rank, fan_in, dtype=dtype, device=device)
        b_all = torch.zeros(len(pairs), fan_out, rank, dtype=dtype, device=device)
        for n, (a, b, _) in enumerate(pairs):
            a_all[n, : a.shape[0]] = a
            b_all[n, :, : b.shape[1]] = b
        scale = torch.tensor([s for _, _, s in pairs], dtype=dtype, device=device)
        return LoRAStack(a_all, b_all, scale)


@dataclass(frozen=True)
class Gathered:
    """Per-token weights: ``a`` (T, in, r), ``b`` (T, r, out), ``scale`` (T, 1); zero for -1."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor


# --- the specification ----------------------------------------------------------------------


def shrink_reference(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """h[i] = x[i] @ a[idx[i]].T, zeros where idx[i] == -1. x (T, in), a (N, r, in)."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for i, n in enumerate(idx.tolist()):
        if n >= 0:
            h[i] = x[i] @ a[n].T
    return h


def expand_reference(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """y[i] + h[i] @ b[idx[i]].T * scale[idx[i]], y[i] where idx[i] == -1. b (N, out, r)."""
    out = y.clone()
    for i, n in enumerate(idx.tolist()):
        if n >= 0:
            out[i] = y[i] + (h[i] @ b[n].T) * scale[n]
    return out


# --- fast CPU path: segments ----------------------------------------------------------------


@dataclass(frozen=True)
class _Segments:
    """Tokens grouped by adapter, each group padded to the longest: ``tokens`` (K, L) holds
    token positions (0 where padded), ``valid`` (K, L) marks real ones, ``adapters`` (K,)."""

    tokens: torch.Tensor
    valid: torch.Tensor
    adapters: torch.Tensor


def _segments(idx: torch.Tensor) -> _Segments:
    used = torch.nonzero(idx >= 0).flatten()
    order = used[torch.argsort(idx[used], stable=True)]
    adapters, counts = torch.unique_consecutive(idx[order], return_counts=True)
    longest = int(counts.max()) if len(counts) else 0
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(longest, device=idx.device)
    valid = offsets[None, :] < counts[:, None]
    where = (starts[:, None] + offsets[None, :]).clamp(max=max(len(order) - 1, 0))
    tokens = torch.where(valid, order[where] if len(order) else where, 0)
    return _Segments(tokens, valid, adapters)


def shrink_segments(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """One batched matmul over the adapters' token groups (padded to the longest group)."""
    seg = _segments(idx)
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    if seg.adapters.numel():
        grouped = torch.bmm(x[seg.tokens], a[seg.adapters].transpose(1, 2))
        h[seg.tokens[seg.valid]] = grouped[seg.valid]
    return h


def expand_segments(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    seg = _segments(idx)
    out = y.clone()
    if seg.adapters.numel():
        grouped = torch.bmm(h[seg.tokens], b[seg.adapters].transpose(1, 2))
        grouped = grouped * scale[seg.adapters][:, None, None]
        out.index_add_(0, seg.tokens[seg.valid], grouped[seg.valid])
    return out


# --- fast CPU path: gathered weights --------------------------------------------------------


def gather(stack: LoRAStack, idx: torch.Tensor) -> Gathered:
    """Each token's weights (zeros for -1), laid out for batched matmuls."""
    safe = idx.clamp(min=0)
    used = (idx >= 0).to(stack.a.dtype)
    a = stack.a[safe].transpose(1, 2) * used[:, None, None]
    b = stack.b[safe].transpose(1, 2)
    scale = (stack.scale[safe] * used)[:, None]
    return Gathered(a.contiguous(), b.contiguous(), scale)


def shrink_gathered(x: torch.Tensor, gathered: Gathered) -> torch.Tensor:
    """x (T, in) or (T, S, in) with one adapter per row: h = x @ a per row."""
    rows = x if x.dim() == 3 else x[:, None, :]
    h = torch.bmm(rows, gathered.a)
    return h if x.dim() == 3 else h[:, 0, :]


def expand_gathered(y: torch.Tensor, h: torch.Tensor, gathered: Gathered) -> torch.Tensor:
    rows = h if h.dim() == 3 else h[:, None, :]
    delta = torch.bmm(rows, gathered.b)
    if h.dim() == 3:
        return y + delta * gathered.scale[:, :, None]
    return y + delta[:, 0, :] * gathered.scale


# --- dispatch -------------------------------------------------------------------------------


def lora_shrink(x: torch.Tensor, stack: LoRAStack, idx: torch.Tensor) -> torch.Tensor:
    """h[i] = x[i] @ A[idx[i]].T (zeros for -1): Triton on CUDA, segments on the CPU."""
    if x.is_cuda:
        from kernels.lora_triton import shrink_triton

        return shrink_triton(x, stack.a, idx)
    return shrink_segments(x, stack.a, idx)


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, stack: LoRAStack, idx: torch.Tensor
) -> torch.Tensor:
    """y[i] + h[i] @ B[idx[i]].T * scale[idx[i]] (unchanged for -1)."""
    if y.is_cuda:
        from kernels.lora_triton import expand_triton

        return expand_triton(y, h, stack.b, stack.scale, idx)
    return expand_segments(y, h, stack.b, stack.scale, idx)
