"""Rollout signal: how many GenUI groups carry an advantage for RLOO, under the graded verifier
(``verifier-2``) against pass/fail (``verifier-1``), on the same samples.

The root release of SmolLM2-135M-Instruct (root adapters are version 0: the base model) with
``harness@0`` samples K episodes of each GenUI prompt of the training bank (the development
data: no contract task is in it), under the GenUI grammar as the loop's rollouts are. Each
group is then judged twice: ``verifier-1`` rewards 1.0 when the contract's checker passes,
else 0.0; ``verifier-2`` gives the share of what the task asks that the tree shows. A group
carries signal when its rewards are not all alike. Both verifiers pass the same samples.

Usage: python -m bench.rollout_signal [--model PATH] [--prompts N] [--samples K] [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from bench.report import Row, report, row
from core.harness.artifact import root_version
from core.settings import default_home
from core.tasks import GenUIChecker
from engines.local.engine import LocalEngine
from infra.identity_adapter import write_identity_adapter
from infra.models import pull_model
from learners.evaluation.checkers import check
from learners.evaluation.contract_runner import DEFAULT_CONTRACT, load_contract
from learners.rollouts.environments import CheckerVerifier, load_environments
from learners.rollouts.episodes import Group, Sampler
from learners.rollouts.job import RolloutJob, sample_groups
from learners.tasks import DEFAULT_BANK

BASE_MODEL = "smollm2-135m-instruct"


def _signal(rewards: list[float]) -> bool:
    return len(set(rewards)) > 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=24, help="GenUI prompts of the bank")
    parser.add_argument("--samples", type=int, default=8, help="K, samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    environments = [
        env
        for env in load_environments(load_contract(DEFAULT_CONTRACT), DEFAULT_BANK).values()
        if isinstance(env.task.checker, GenUIChecker)
    ][: args.prompts]
    job = RolloutJob(
        job_id=uuid.UUID(int=args.seed),
        specialist="genui",
        environments=[env.task.id for env in environments],
        samples=args.samples,
        seed=args.seed,
    )
    engine = LocalEngine(model_dir)
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            write_identity_adapter(model_dir, Path(scratch), base_model=BASE_MODEL, rank=16, seed=0)
            engine.load_adapter("genui@0", scratch)
            harness = root_version()
            tokens = min(harness.spec.for_specialist("genui").decoding.max_new_tokens, 256)
            sampler = Sampler(engine, harness, "genui", "genui@0", job.temperature, tokens)
            groups = asyncio.run(
                sample_groups(sampler, job, environments, CheckerVerifier(), lambda _: None)
            )
    finally:
        engine.close()
    report("rollout_signal", _rows(groups, time.monotonic() - started))


def _rows(groups: list[Group], seconds: float) -> list[Row]:
    graded = [[v.reward or 0.0 for v in g.verdicts] for g in groups]
    passed = [
        [1.0 if check(g.environment.task, steps[0].output) else 0.0 for steps in g.episodes]
        for g in groups
    ]
    samples = sum(len(r) for r in passed)
    assert [[v.passed for v in g.verdicts] for g in groups] == [
        [p == 1.0 for p in r] for r in passed
    ]  # the graded verifier passes exactly what the checker passes
    with_signal = sum(_signal(r) for r in graded)
    before = sum(_signal(r) for r in passed)
    pass_share = sum(map(sum, passed)) / samples
    n = len(groups)
    return [
        row(
            f"groups with signal, verifier-2 ({n} prompts)", with_signal, "groups", before, "report"
        ),
        row(
            "share of groups with signal, verifier-2",
            100 * with_signal / n,
            "%",
            100 * before / n,
            "report",
        ),
        row("mean reward, verifier-2", sum(map(sum, graded)) / samples, "", pass_share, "report"),
        row("pass@1 (both verifiers)", 100 * pass_share, "%", 100 * pass_share, "report"),
        row(f"sampling time ({samples} episodes)", seconds, "s", seconds, "report"),
    ]


if __name__ == "__main__":
    main()
