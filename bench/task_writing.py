"""Tasks the loop writes itself: how many proposals a writer's rule can check and keep, and how
many of the kept tasks the specialist then solves.

The root release of SmolLM2-135M-Instruct (root adapters are version 0: the base model) with
``harness@0`` writes ``--proposals`` prompts of each family (``learners.rollouts.writing``: GenUI
requests that quote what to show, two-number calculator requests), shown three bank prompts of
the family each time. Each proposal is kept when its family's rule derives a checker from it and
it is new (no near copy of a bank prompt or of a contract task), else dropped by reason. Each
kept task is then rolled out K times under the specialist's grammar, as the loop's rollouts are,
and counted solved when a sample passes its derived checker. Nothing here is a contract score.

Usage: python -m bench.task_writing [--model PATH] [--proposals N] [--samples K] [--seed S]
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
from engines.local.engine import LocalEngine
from infra.identity_adapter import write_identity_adapter
from infra.models import pull_model
from learners.evaluation.contract_runner import held_out_tasks
from learners.rollouts.environments import CheckerVerifier, Environment
from learners.rollouts.episodes import Sampler
from learners.rollouts.job import RolloutJob, sample_groups
from learners.rollouts.writing import FAMILIES, DropReason, Family, Written, propose_tasks
from learners.tasks import load_bank

BASE_MODEL = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--proposals", type=int, default=32, help="proposals per family")
    parser.add_argument("--samples", type=int, default=8, help="K, samples per kept task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    bank, held_out, harness = load_bank(), held_out_tasks(), root_version()
    engine = LocalEngine(model_dir)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            write_identity_adapter(model_dir, Path(scratch), base_model=BASE_MODEL, rank=16, seed=0)
            for specialist in ("chat", *FAMILIES.values()):
                engine.load_adapter(f"{specialist}@0", scratch)
            for family, specialist in FAMILIES.items():
                started = time.monotonic()
                seeds = [args.seed * 100_000 + n for n in range(args.proposals)]
                written = asyncio.run(
                    propose_tasks(engine, "chat@0", family, bank, held_out, seeds)
                )
                writing_s = time.monotonic() - started
                kept = [w.task for w in written if w.task is not None]
                solved = 0
                if kept:
                    job = RolloutJob(
                        job_id=uuid.UUID(int=args.seed),
                        specialist=specialist,
                        environments=[task.id for task in kept],
                        samples=args.samples,
                        seed=args.seed,
                    )
                    decoding = harness.spec.for_specialist(specialist).decoding
                    sampler = Sampler(
                        engine,
                        harness,
                        specialist,
                        f"{specialist}@0",
                        job.temperature,
                        min(decoding.max_new_tokens, 256),
                    )
                    groups = asyncio.run(
                        sample_groups(
                            sampler,
                            job,
                            [Environment("written", task) for task in kept],
                            CheckerVerifier(),
                            lambda _: None,
                        )
                    )
                    solved = sum(g.any_passed for g in groups)
                rows += _rows(family, written, solved, writing_s)
                for w in written[:6]:
                    print(f"{family}: {w.dropped or 'kept'}: {w.prompt!r}")
    finally:
        engine.close()
    report("task_writing", rows)


def _rows(family: Family, written: list[Written], solved: int, seconds: float) -> list[Row]:
    kept = sum(w.task is not None for w in written)
    reasons: tuple[DropReason, ...] = (
        "no_checker",
        "copies_the_bank",
        "near_a_contract_task",
        "repeated",
    )
    rows = [
        row(f"{family}: proposals", len(written), "tasks", len(written), "report"),
        row(f"{family}: kept", kept, "tasks", len(written), "report"),
        row(f"{family}: kept tasks solved (pass@K)", solved, "tasks", kept, "report"),
        row(f"{family}: writing time", seconds, "s", seconds, "report"),
    ]
    for reason in reasons:
        dropped = sum(w.dropped == reason for w in written)
        rows.append(row(f"{family}: dropped, {reason}", dropped, "tasks", len(written), "report"))
    return rows


if __name__ == "__main__":
    main()
