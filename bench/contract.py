"""The whole contract on one release: every task of contract v2 (324) on SmolLM2-135M without
adapters, served with `harness@0`, through the local engine as the learning loop runs it
(`learners.evaluation.contract_runner.run_contract`: every task in flight at once up to the
contract's concurrency, each with its specialist's context, grammar and answer budget).

Baseline, in the same run: the same engine with its prefix cache off (every prompt computed
whole, as before the cache). Target (issue 18): the whole contract v2 on one release in
<= 3 minutes on this CPU. Also reported: tokens generated, passes per suite (the two runs must
agree: the cache changes time, not answers).

Usage: python -m bench.contract [--model PATH] [--contract v1|v2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from bench.report import Row, report, row
from core.harness.artifact import root_version
from core.settings import default_home
from engines.local.engine import LocalEngine
from engines.local.limits import EngineLimits
from infra.models import pull_model
from learners.evaluation.contract_runner import (
    CONTRACT_V1,
    CONTRACT_V2,
    ContractRun,
    load_contract,
    run_contract,
)

BASE_MODEL = "smollm2-135m-instruct"


def timed_run(
    model_dir: Path, contract_path: Path, *, cache: bool
) -> tuple[float, int, ContractRun]:
    """Seconds for the whole contract, tokens generated, and the outcomes."""
    contract = load_contract(contract_path)
    limits = EngineLimits() if cache else EngineLimits(max_prefix_cache_bytes=0)
    engine = LocalEngine(model_dir, limits=limits)
    try:
        start = time.perf_counter()
        outcome = asyncio.run(
            run_contract(
                engine,
                dict.fromkeys(contract.specialists()),
                contract,
                harness=root_version(),
            )
        )
        seconds = time.perf_counter() - start
        print(f"prefix cache {'on' if cache else 'off'}: {seconds:.1f} s, {engine.stats}")
        print(f"  prefix cache: {engine.prefixes.stats}")
        return seconds, engine.stats["tokens"], outcome
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--contract", choices=["v1", "v2"], default="v2")
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    path = CONTRACT_V2 if args.contract == "v2" else CONTRACT_V1
    print(f"contract {args.contract}, torch threads: {torch.get_num_threads()}")
    off_s, off_tokens, off = timed_run(model_dir, path, cache=False)
    on_s, on_tokens, on = timed_run(model_dir, path, cache=True)
    tasks = sum(len(p) for p in on.passed.values())
    rows: list[Row] = [
        row(f"contract {args.contract}, {tasks} tasks, one release", on_s, "s", off_s, "<= 180 s"),
        row("same, prefix cache off (baseline)", off_s, "s", off_s, "report"),
        row(
            "tokens/s over the whole contract",
            on_tokens / on_s,
            "tokens/s",
            off_tokens / off_s,
            "report",
        ),
        row("tokens generated", on_tokens, "tokens", off_tokens, "report"),
    ]
    rows += [
        row(
            f"suite {suite}: passed",
            100 * on.scores()[suite],
            "%",
            100 * off.scores()[suite],
            "report",
        )
        for suite in on.passed
    ]
    report("contract", rows)


if __name__ == "__main__":
    main()
