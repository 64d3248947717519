"""Fast multi-LoRA paths against the reference, over many shapes, ranks, adapter counts,
dtypes, token orders and -1 rows.

Tolerances, in units of the dtype's rounding (``tests/numeric.py``) relative to the largest
magnitude of the expected result, computed in float64 from the inputs as rounded to the dtype:
float32 32 ulps (5 seen on the default and AVX2 kernels and on one thread), bfloat16 2.5 ulps
(1.2 seen: the low-rank activations are rounded to bfloat16 once more). Guards each fast path's
indexing (a token given another adapter's weights or scale) and its precision (an intermediate
kept in a narrower dtype than its inputs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels.lora import (
    LoRAStack,
    expand_gathered,
    expand_reference,
    expand_segments,
    gather,
    lora_expand,
    lora_shrink,
    shrink_gathered,
    shrink_reference,
    shrink_segments,
)
from tests.numeric import assert_close, eps

pytestmark = pytest.mark.numeric

ULPS = {torch.float32: 32, torch.bfloat16: 2.5}


@dataclass(frozen=True)
class Case:
    tokens: int
    fan_in: int
    fan_out: int
    ranks: tuple[int, ...]
    order: str  # "random", "sorted", "one-adapter"
    unused: float  # share of -1 tokens
    dtype: torch.dtype
    seed: int

    def build(self) -> tuple[torch.Tensor, torch.Tensor, LoRAStack, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        pairs = [
            (
                torch.randn(r, self.fan_in, generator=gen).to(self.dtype),
                torch.randn(self.fan_out, r, generator=gen).to(self.dtype),
                float(torch.rand(1, generator=gen)) * 2 + 0.1,
            )
            for r in self.ranks
        ]
        n = len(self.ranks)
        if self.order == "one-adapter":
            idx = torch.full((self.tokens,), n - 1)
        else:
            idx = torch.randint(0, n, (self.tokens,), generator=gen)
            if self.order == "sorted":
                idx = idx.sort().values
        drop = torch.rand(self.tokens, generator=gen) < self.unused
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
        x = torch.randn(self.tokens, self.fan_in, generator=gen).to(self.dtype)
        y = torch.randn(self.tokens, self.fan_out, generator=gen).to(self.dtype)
        return x, y, LoRAStack.of(pairs), idx


def cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1234)
    out = []
    for seed in range(40):
        count = [1, 2, 3, 8, 17, 32][seed % 6]
        picks = torch.randint(0, 5, (count,), generator=gen)
        ranks = tuple(int(r) for r in torch.tensor([4, 8, 16, 32, 64])[picks])
        out.append(
            Case(
                tokens=[1, 7, 64, 256, 301][seed % 5],
                fan_in=[16, 64, 576, 96][seed % 4],
                fan_out=[24, 192, 576, 1536][(seed // 4) % 4],
                ranks=ranks,
                order=["random", "sorted", "one-adapter"][seed % 3],
                unused=[0.0, 0.25, 1.0][(seed // 3) % 3] if seed % 7 else 0.5,
                dtype=[torch.float32, torch.bfloat16][seed % 2],
                seed=seed,
            )
        )
    return out


def expected(x: torch.Tensor, y: torch.Tensor, stack: LoRAStack, idx: torch.Tensor) -> torch.Tensor:
    f64 = LoRAStack(stack.a.double(), stack.b.double(), stack.scale.double())
    h = shrink_reference(x.double(), f64.a, idx)
    return expand_reference(y.double(), h, f64.b, f64.scale, idx)


def close(actual: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.abs().max()) or 1.0
    error = float((actual.double() - want).abs().max())
    assert error <= ULPS[dtype] * eps(dtype) * scale, f"max error {error:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"s{c.seed}-{c.dtype}-{c.order}")
def test_fast_paths_match_the_reference(case: Case) -> None:
    x, y, stack, idx = case.build()
    want = expected(x, y, stack, idx)
    close(
        expand_segments(y, shrink_segments(x, stack.a, idx), stack.b, stack.scale, idx),
        want,
        case.dtype,
    )
    gathered = gather(stack, idx)
    close(expand_gathered(y, shrink_gathered(x, gathered), gathered), want, case.dtype)
    close(lora_expand(y, lora_shrink(x, stack, idx), stack, idx), want, case.dtype)
    # -1 rows are untouched, bit for bit.
    untouched = idx < 0
    fast = lora_expand(y, lora_shrink(x, stack, idx), stack, idx)
    assert torch.equal(fast[untouched], y[untouched])


def test_reference_is_the_per_token_formula() -> None:
    """Guards the reference itself: a token given another adapter's factors or scale, or its
    product rounded to a narrower dtype, is off by far more than float32's rounding."""
    x, y, stack, idx = Case(5, 8, 6, (2, 3), "random", 0.3, torch.float32, 7).build()
    out = expand_reference(y, shrink_reference(x, stack.a, idx), stack.b, stack.scale, idx)
    for i, n in enumerate(idx.tolist()):
        if n < 0:
            assert torch.equal(out[i], y[i])
        else:
            manual = y[i] + (x[i] @ stack.a[n].T) @ stack.b[n].T * stack.scale[n]
            assert_close(out[i], manual, ulps=16)


def test_gathered_path_accepts_sequences_per_row() -> None:
    _, _, stack, idx = Case(4, 32, 16, (4, 8), "random", 0.25, torch.float32, 3).build()
    seq = torch.randn(4, 5, 32)
    base = torch.randn(4, 5, 16)
    gathered = gather(stack, idx)
    out = expand_gathered(base, shrink_gathered(seq, gathered), gathered)
    for row in range(4):
        row_idx = idx[row].repeat(5)
        want = expected(seq[row], base[row], stack, row_idx)
        close(out[row], want, torch.float32)


def test_triton_kernels_match_the_reference_in_the_interpreter() -> None:
    """The Triton kernels, run by Triton's interpreter on CPU tensors (no GPU here)."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "tests.unit.triton_check"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "triton kernels match" in result.stdout
