"""How the local engine's throughput grows with the requests in flight, on SmolLM2-135M-Instruct
with eight rank-16 adapters: 8, 16, 32 and 64 concurrent requests x 64 new tokens (EOS
ignored), greedy, request i on adapter i mod 8, against 8 in the same run. The engine's batch
is raised to 64 rows for the run (`EngineLimits.max_batch`; 16 by default), so each count is
one batch. In float32, and in bfloat16 where the CPU has it natively.

Target (issue 35): 32 concurrent requests >= 1.6x the tokens/s of 8.

The table before ``engines/local/threads.py`` read low at 8 requests: the scheduler allocated its
grammar bitmask (one row per batch row) on the building thread, above about 21 rows that ran in
parallel and left a second OpenMP team in the process, and the engine's steps ran about 2x
slower (see ``docs/serving.md``, threads).

The contract and the rollouts keep `learners.evaluation.contract_runner.CONCURRENCY` (16)
requests in flight; this table is what that number is chosen by.

Usage: python -m bench.concurrency [--model PATH] [--tokens T]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.engine import in_process
from bench.report import Row, report, row
from bench.workload import make_adapters, throughput
from core.settings import default_home
from infra.hardware import has_native_bf16
from infra.models import pull_model

COUNTS = (8, 16, 32, 64)
TARGETS = {32: ">= 1.6x"}


def run_counts(
    model_dir: str, adapters: dict[str, str], tokens: int, dtype: str
) -> dict[str, float]:
    from engines.local.engine import LocalEngine
    from engines.local.limits import EngineLimits

    limits = EngineLimits(max_batch=max(COUNTS), max_queue=2 * max(COUNTS))
    engine = LocalEngine(Path(model_dir), limits=limits, dtype=getattr(torch, dtype))
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    names = list(adapters)
    runs = {str(n): [names[i % len(names)] for i in range(n)] for n in COUNTS}
    try:
        return throughput(engine, runs, tokens)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: pull SmolLM2)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error("--tokens must be positive")
    model_dir = args.model or pull_model(default_home(), "smollm2-135m-instruct", print)[0]
    dtypes = ["float32", *(["bfloat16"] if has_native_bf16() else [])]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="macaron-bench-") as tmp:
        adapters = {k: str(v) for k, v in make_adapters(model_dir, Path(tmp), 8).items()}
        for dtype in dtypes:
            print(f"{dtype}: {', '.join(map(str, COUNTS))} requests in flight")
            measured = in_process(run_counts, str(model_dir), adapters, args.tokens, dtype)
            base = measured[str(COUNTS[0])]
            rows += [
                row(
                    f"{dtype}: {n} requests on 8 adapters (vs {COUNTS[0]})",
                    measured[str(n)],
                    "tokens/s",
                    base,
                    TARGETS.get(n, "report"),
                )
                for n in COUNTS
            ]
    report("concurrency", rows)


if __name__ == "__main__":
    main()
