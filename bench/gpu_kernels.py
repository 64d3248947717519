"""The Triton multi-LoRA kernels on a CUDA GPU: checked against the reference, then timed
against the reference and the fast CPU-style path run on the GPU, on SmolLM2's projection
sizes (256 tokens over 8 adapters, rank 16).

One short prepared script for a GPU machine. Without CUDA it says so and exits 0, having
checked and timed nothing.

Usage: python -m bench.gpu_kernels [--tokens N] [--adapters K] [--rank R]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from bench.report import Row, report, row
from kernels.lora import (
    LoRAStack,
    expand_reference,
    expand_segments,
    shrink_reference,
    shrink_segments,
)

SHAPES = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "gate_proj": (576, 1536),
    "down_proj": (1536, 576),
}


def timed_cuda(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def check_and_time(
    name: str,
    fan_in: int,
    fan_out: int,
    dtype: torch.dtype,
    args: argparse.Namespace,
    gen: torch.Generator,
) -> Row:
    """Check the Triton kernels on one projection against the CPU reference, then time them."""
    from kernels.lora_triton import expand_triton, shrink_triton

    pairs = [
        (
            torch.randn(args.rank, fan_in, generator=gen),
            torch.randn(fan_out, args.rank, generator=gen),
            0.5,
        )
        for _ in range(args.adapters)
    ]
    cpu = LoRAStack.of(pairs)
    idx = torch.randint(-1, args.adapters, (args.tokens,), generator=gen)
    x = torch.randn(args.tokens, fan_in, generator=gen)
    y = torch.randn(args.tokens, fan_out, generator=gen)
    want = expand_reference(y, shrink_reference(x, cpu.a, idx), cpu.b, cpu.scale, idx)
    a, b, s = (t.to("cuda", dtype) for t in (cpu.a, cpu.b, cpu.scale))
    xg, yg, ig = x.to("cuda", dtype), y.to("cuda", dtype), idx.to("cuda")
    got = expand_triton(yg, shrink_triton(xg, a, ig), b, s, ig).float().cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = float((got - want).abs().max() / want.abs().max())
    if error > tolerance:
        raise SystemExit(f"{name} {dtype}: relative error {error:.2e} > {tolerance}")
    t_triton = timed_cuda(lambda: expand_triton(yg, shrink_triton(xg, a, ig), b, s, ig))
    t_torch = timed_cuda(lambda: expand_segments(yg, shrink_segments(xg, a, ig), b, s, ig))
    label = f"{name} {str(dtype).removeprefix('torch.')}"
    return row(
        f"triton {label} (vs torch segments on GPU)",
        args.tokens / t_triton,
        "tokens/s",
        args.tokens / t_torch,
        "report",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing checked or timed (run this on a GPU machine)")
        sys.exit(0)
    gen = torch.Generator().manual_seed(0)
    rows = [
        check_and_time(name, fan_in, fan_out, dtype, args, gen)
        for dtype in (torch.float32, torch.bfloat16)
        for name, (fan_in, fan_out) in SHAPES.items()
    ]
    print(f"all kernels match the reference ({torch.cuda.get_device_name()})")
    report("gpu_kernels", rows)


if __name__ == "__main__":
    main()
