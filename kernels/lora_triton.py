"""Triton kernels for ``kernels.lora`` (same semantics as ``shrink_reference`` and
``expand_reference``). Imported only on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` to check
them against the reference. One program per token (and output block); accumulation in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 64
BLOCK_OUT = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    idx_ptr,
    h_ptr,
    fan_in,
    rank,
    stride_xt,
    stride_an,
    stride_ar,
    stride_ht,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.load(idx_ptr + t)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if n >= 0:
        for k0 in range(0, fan_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < fan_in, other=0.0)
            a = tl.load(
                a_ptr + n * stride_an + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=(offs_r[:, None] < rank) & (offs_k[None, :] < fan_in),
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x[None, :].to(tl.float32), axis=1)
    tl.store(h_ptr + t * stride_ht + offs_r, acc.to(h_ptr.dtype.element_ty), mask=offs_r < rank)


@triton.jit
def _expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    scale_ptr,
    idx_ptr,
    out_ptr,
    fan_out,
    rank,
    stride_yt,
    stride_ht,
    stride_bn,
    stride_bo,
    stride_ot,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    y = tl.load(y_ptr + t * stride_yt + offs_o, mask=offs_o < fan_out, other=0.0)
    n = tl.load(idx_ptr + t)
    if n >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t * stride_ht + offs_r, mask=offs_r < rank, other=0.0)
        b = tl.load(
            b_ptr + n * stride_bn + offs_o[:, None] * stride_bo + offs_r[None, :],
            mask=(offs_o[:, None] < fan_out) & (offs_r[None, :] < rank),
            other=0.0,
        )
        scale = tl.load(scale_ptr + n).to(tl.float32)
        delta = tl.sum(b.to(tl.float32) * h[None, :].to(tl.float32), axis=1) * scale
        y = (y.to(tl.float32) + delta).to(y.dtype)
    tl.store(out_ptr + t * stride_ot + offs_o, y, mask=offs_o < fan_out)


def shrink_triton(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    tokens, fan_in = x.shape
    rank = a.shape[1]
    x, a = x.contiguous(), a.contiguous()
    h = torch.empty(tokens, rank, dtype=x.dtype, device=x.device)
    _shrink_kernel[(tokens,)](
        x,
        a,
        idx.contiguous(),
        h,
        fan_in,
        rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        h.stride(0),
        BLOCK_K=BLOCK_IN,
        BLOCK_R=triton.next_power_of_2(rank),
    )
    return h


def expand_triton(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    tokens, fan_out = y.shape
    rank = b.shape[2]
    y, h, b = y.contiguous(), h.contiguous(), b.contiguous()
    out = torch.empty_like(y)
    grid = (tokens, triton.cdiv(fan_out, BLOCK_OUT))
    _expand_kernel[grid](
        y,
        h,
        b,
        scale.contiguous(),
        idx.contiguous(),
        out,
        fan_out,
        rank,
        y.stride(0),
        h.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_O=BLOCK_OUT,
        BLOCK_R=triton.next_power_of_2(rank),
    )
    return out
