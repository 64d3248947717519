"""Where a decode step of the local engine goes, on SmolLM2-135M-Instruct: 8 concurrent requests
x 64 tokens on one adapter and on eight (rank 16, every linear layer), in each dtype, profiled
with torch.profiler. Each row is one kind of work's milliseconds per decode step; the baseline
is the same kind on one adapter, so a row's ratio says what mixing adapters costs there.

Kinds, by the profiler's operator names: attention (``scaled_dot_product_attention``), matrix
products (``mm``, ``addmm``, ``bmm``, ``linear``: the base layers and the adapters), copies and
indexing (``copy_``, ``index``, ``cat``, ``contiguous``...), and the rest; plus the wall time per
step (under the profiler, which adds its own overhead to every operator).

Usage: python -m bench.engine_profile [--model PATH] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.report import Row, report, row
from bench.workload import make_adapters, workload
from core.settings import default_home
from engines.local.base_model import load_base_model
from engines.local.decoder import forward
from engines.local.kv_pool import KVPool
from engines.local.lora_layers import (
    BatchAdapters,
    adapter_dtype,
    install,
    read_adapter,
    read_adapter_config,
)
from engines.prompts import chat_prompt_ids
from infra.models import pull_model

Steps = dict[str, dict[str, float]]  # run (single, mixed) -> kind -> ms per decode step

KINDS = {
    "attention": ("scaled_dot_product", "flash_attention"),
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"),
    "copies and indexing": (
        "aten::copy_",
        "aten::index",
        "aten::cat",
        "aten::contiguous",
        "aten::clone",
        "aten::to",
        "aten::_to_copy",
        "aten::slice",
        "aten::select",
        "aten::expand",
    ),
}


def kind_of(name: str) -> str:
    return next((k for k, marks in KINDS.items() if any(m in name for m in marks)), "other")


def profiled(model_dir: Path, adapters: dict[str, Path], dtype: torch.dtype, tokens: int) -> Steps:
    """Milliseconds per decode step of each kind (self CPU time) and of the wall clock, for
    8 rows on one adapter and on eight: the engine's own forward pass and multi-LoRA layers,
    driven here in this thread (the profiler sees only its own thread) without the scheduler,
    sampling or detokenization around them."""
    tokenizer, model = load_base_model(model_dir, dtype)
    batch = BatchAdapters(dtype=adapter_dtype(dtype, "cpu"))  # as the engine holds them
    shapes = install(model, batch)
    weights = {
        name: read_adapter(name, path, read_adapter_config(path), shapes, batch.dtype)
        for name, path in adapters.items()
    }
    runs = workload(list(adapters), 8, base=False)
    found: Steps = {}
    with torch.inference_mode():
        # Each run twice, alternating, the second kept: the first runs of a process pay for
        # allocations and kernel selection that would be charged to whichever came first.
        for label, assign in [*runs.items(), *runs.items()]:
            per_row = [weights[name] if name else None for name in assign]
            prompts = [
                chat_prompt_ids(tokenizer, [{"role": "user", "content": f"Tell me of {n}."}])
                for n in range(len(assign))
            ]
            pool = KVPool(model, len(prompts))
            slots = [pool.acquire() for _ in prompts]
            last = []
            for slot, weight, prompt in zip(slots, per_row, prompts, strict=True):
                batch.assign([weight], len(prompt))
                last.append(int(forward(model, [slot], [list(prompt)])[0].argmax()))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                for _ in range(tokens):
                    batch.assign(per_row, 1)
                    logits = forward(model, slots, [[t] for t in last])
                    last = [int(t) for t in logits.argmax(dim=-1)]
                wall = time.perf_counter() - start
            totals: dict[str, float] = defaultdict(float)
            for event in prof.key_averages():
                totals[kind_of(event.key)] += event.self_cpu_time_total / 1000 / tokens
            found[label] = {**totals, "wall": wall * 1000 / tokens}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: pull SmolLM2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), "smollm2-135m-instruct", print)[0]
    with tempfile.TemporaryDirectory(prefix="macaron-profile-") as tmp:
        adapters = make_adapters(model_dir, Path(tmp), 8)
        steps = profiled(model_dir, adapters, getattr(torch, args.dtype), args.tokens)
    single, mixed = steps["single"], steps["mixed"]
    rows: list[Row] = [
        row(
            f"{args.dtype}, 8 adapters: {kind} per decode step (vs one adapter)",
            mixed.get(kind, 0.0),
            "ms",
            single.get(kind, 0.0),
            "report",
        )
        for kind in ("wall", *KINDS, "other")
    ]
    path = report(f"engine_profile-{args.dtype}", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
