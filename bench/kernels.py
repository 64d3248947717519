"""Multi-LoRA ops on one SmolLM2-135M layer's projections (q, k, v, o, gate, up, down):
a mixed batch of 256 tokens over 8 adapters, rank 16, base matmul included.

Measured in one run: the reference (per-token loop), the two fast CPU paths (segments;
gathered, with and without the gather), and PEFT's own mixed-batch path (``adapter_names=``);
and the fast path with every token on one adapter, for the mixed-adapter overhead.

Usage: python -m bench.kernels [--tokens N] [--adapters K] [--rank R] [--repeats N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.nn import functional as F

from bench.report import report, row
from kernels.lora import (
    LoRAStack,
    expand_gathered,
    expand_reference,
    expand_segments,
    gather,
    shrink_gathered,
    shrink_reference,
    shrink_segments,
)

# SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536.
PROJECTIONS = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}


class Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            setattr(self, name, nn.Linear(fan_in, fan_out, bias=False))


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` wall times, after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if min(args.tokens, args.adapters, args.rank, args.repeats) < 1:
        parser.error("all arguments must be positive")
    torch.manual_seed(0)
    n, tokens = args.adapters, args.tokens

    model = Projections()
    names = [f"a{i}" for i in range(n)]
    for name in names:
        config = LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=list(PROJECTIONS),
            init_lora_weights=False,
        )
        inject_adapter_in_model(config, model, adapter_name=name)
    model.eval()
    idx = torch.arange(tokens) % n
    idx = idx[torch.randperm(tokens)]
    per_row = [names[i] for i in idx.tolist()]
    stacks = {}
    for proj in PROJECTIONS:
        layer = getattr(model, proj)
        stacks[proj] = LoRAStack.of(
            [
                (layer.lora_A[a].weight.detach(), layer.lora_B[a].weight.detach(), layer.scaling[a])
                for a in names
            ]
        )
    weights = {proj: getattr(model, proj).base_layer.weight.detach() for proj in PROJECTIONS}
    inputs = {proj: torch.randn(tokens, fan_in) for proj, (fan_in, _) in PROJECTIONS.items()}

    def peft_mixed() -> None:
        for proj in PROJECTIONS:
            getattr(model, proj)(inputs[proj][:, None, :], adapter_names=per_row)

    def segments(ids: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for proj, stack in stacks.items():
                x = inputs[proj]
                y = F.linear(x, weights[proj])
                expand_segments(y, shrink_segments(x, stack.a, ids), stack.b, stack.scale, ids)

        return run

    def gathered_fresh() -> None:
        for proj, stack in stacks.items():
            x, g = inputs[proj], gather(stack, idx)
            expand_gathered(F.linear(x, weights[proj]), shrink_gathered(x, g), g)

    cached = {proj: gather(stack, idx) for proj, stack in stacks.items()}

    def gathered_cached() -> None:
        for proj, g in cached.items():
            x = inputs[proj]
            expand_gathered(F.linear(x, weights[proj]), shrink_gathered(x, g), g)

    def reference() -> None:
        for proj, stack in stacks.items():
            x = inputs[proj]
            y = F.linear(x, weights[proj])
            expand_reference(y, shrink_reference(x, stack.a, idx), stack.b, stack.scale, idx)

    def base_only() -> None:
        for proj in PROJECTIONS:
            F.linear(inputs[proj], weights[proj])

    with torch.inference_mode():
        t_base = timed(base_only, args.repeats)
        t_peft = timed(peft_mixed, args.repeats)
        t_segments = timed(segments(idx), args.repeats)
        t_single = timed(segments(torch.zeros_like(idx)), args.repeats)
        t_fresh = timed(gathered_fresh, args.repeats)
        t_cached = timed(gathered_cached, args.repeats)
        t_reference = timed(reference, max(1, args.repeats // 10))

    def rate(seconds: float) -> float:
        return tokens / seconds

    peft = rate(t_peft)
    label = f"{tokens} tokens / {n} adapters, rank {args.rank}, one layer"
    # The LoRA work alone: the layer's time less the frozen matmuls, timed in the same run.
    lora_peft = rate(max(t_peft - t_base, 1e-9))

    def lora_rate(seconds: float) -> float:
        return rate(max(seconds - t_base, 1e-9))

    rows = [
        row(
            f"segments, LoRA part ({label})", lora_rate(t_segments), "tokens/s", lora_peft, ">= 2x"
        ),
        row("gathered incl. gather, LoRA part", lora_rate(t_fresh), "tokens/s", lora_peft, ">= 2x"),
        row(
            "gathered, gather kept (engine decode), LoRA part",
            lora_rate(t_cached),
            "tokens/s",
            lora_peft,
            "report",
        ),
        row(
            "reference (per-token loop), LoRA part",
            lora_rate(t_reference),
            "tokens/s",
            lora_peft,
            "report",
        ),
        row(
            "segments, whole layer (vs PEFT whole layer)",
            rate(t_segments),
            "tokens/s",
            peft,
            "report",
        ),
        # overhead <= 15 % means mixed time <= 1.15 x single time: throughput ratio >= 0.87
        row(
            "segments, whole layer: mixed (vs one adapter)",
            rate(t_segments),
            "tokens/s",
            rate(t_single),
            ">= 0.87x",
        ),
    ]
    print(
        f"PEFT mixed batch (adapter_names=): {peft:,.0f} tokens/s for the whole layer, "
        f"{lora_peft:,.0f} tokens/s for its LoRA part; frozen matmuls alone {rate(t_base):,.0f}"
    )
    path = report("kernels", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
