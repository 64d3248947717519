"""Tolerances for comparing two floating-point computations of one quantity.

Two computations of the same sums round differently with the order they add in, and that order
changes with the kernels ATen dispatches to (``ATEN_CPU_CAPABILITY``: default, avx2, avx512) and
with the thread count. An elementwise absolute bound holds on one kernel path and fails on
another wherever the values are large. So the tests bound the relative error in the norm,
``||mine - theirs|| / ||theirs||``, by a count of units of the dtype's rounding: its machine
epsilon (2^-23 for float32, 2^-7 for bfloat16), with a reason for the count. The count stays
far below what the defect each test guards against moves the result by.

Tests whose answers depend on how the CPU's kernels round carry the ``numeric`` marker: CI runs
them again under every ATen capability the CPU has and on one thread (``scripts/test-numeric.sh``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Values = torch.Tensor | float | Sequence[float]


def eps(dtype: torch.dtype) -> float:
    """One unit of ``dtype``'s rounding: the gap between 1 and the next number."""
    return torch.finfo(dtype).eps


def relative_error(mine: Values, theirs: Values) -> float:
    """``||mine - theirs|| / ||theirs||``, computed in float64."""
    a, b = (torch.as_tensor(v).detach().double() for v in (mine, theirs))
    return float((a - b).norm() / b.norm())


def assert_close(
    mine: Values, theirs: Values, ulps: float, dtype: torch.dtype = torch.float32
) -> None:
    """``mine`` is ``theirs`` within ``ulps`` units of ``dtype``'s rounding, in the relative
    norm. ``dtype`` is the one the values were computed in (float32 unless said)."""
    unit = eps(dtype)
    error = relative_error(mine, theirs)
    assert error <= ulps * unit, (
        f"relative error {error:.3g} is {error / unit:.1f} ulps, over the {ulps} allowed"
    )
