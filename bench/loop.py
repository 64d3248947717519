"""One generation of the learning loop end to end on SmolLM2-135M, each phase timed, against
the code before issue 33 in the same run.

The demo's path (`macaron demo --generations 1 --specialists genui`): simulated GenUI users
whose oracle sends feedback, the trigger, the snapshot, the CPU recipe in a Celery worker, the
contract, promotion or rejection; each on a fresh local stack (embedded PostgreSQL and Redis on
free ports) in a temporary MACARON_HOME. Harness proposals are off, so the generation is the
one adapter run. Two runs, same seed:
  baseline  contract v2, every task of the candidate in one look (MACARON_FULL_EVALUATION):
            what the loop did before issue 33
  now       contract 2s (the baseline's checkers; the default, contract 3, checks content):
            only the tasks the change can touch, in four looks, stopping once the verdict is
            known

Phases, from the timestamps of the run's events in the log:
  trigger   the feedback that completed the trigger's count -> TrainingRequested (snapshot taken)
  train     TrainingRequested -> CandidateTrained
  evaluate  CandidateTrained -> ContractEvaluated
  decide    ContractEvaluated -> ReleasePromoted or PromotionRejected
Targets (issue 33): feedback to decision <= 300 s and <= 0.35x the baseline; evaluation of a
one-specialist candidate <= 120 s; training <= 90 s.

Usage: python -m bench.loop [--model PATH] [--seed N]   (each half runs in a process of its own:
       --half baseline|now runs one and prints its phases as JSON)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import Row, report, row
from core.settings import Settings, default_home
from infra.local_stack import LocalStack, free_port
from infra.models import pull_model
from infra.postgres.migrate import migrate
from learners.evaluation.contract_runner import CONTRACT_V2, CONTRACT_V2S
from macaron import wiring
from macaron.demo import DemoOptions, run_demo
from macaron.demo.records import DemoReport

BASE_MODEL = "smollm2-135m-instruct"
LOOP = ("TrainingRequested", "CandidateTrained", "ContractEvaluated")
DECIDED = ("ReleasePromoted", "PromotionRejected")


def phases(settings: Settings) -> dict[str, float]:
    """Seconds per phase of the first training run in the log, from its events' timestamps."""
    pool = wiring.pool(settings)
    log = wiring.event_log(settings, pool)
    try:
        events = list(log.read())
    finally:
        log.close()
        pool.close()
    at: dict[str, Any] = {}
    run_id = None
    last_feedback = None
    for event in events:
        kind, when = event.payload.event_type, event.envelope.occurred_at
        if kind == "FeedbackGiven" and run_id is None:
            last_feedback = when
        if kind == "TrainingRequested" and run_id is None:
            run_id = event.payload.run_id  # type: ignore[attr-defined]
        if run_id is not None and getattr(event.payload, "run_id", None) == run_id:
            at.setdefault(kind, when)
    decided = next((at[k] for k in DECIDED if k in at), None)
    if last_feedback is None or decided is None or any(k not in at for k in LOOP):
        raise SystemExit(f"the generation did not finish a run: events seen {sorted(at)}")
    marks = [last_feedback, *(at[k] for k in LOOP), decided]
    names = ["trigger", "train", "evaluate", "decide"]
    times = {n: (b - a).total_seconds() for n, a, b in zip(names, marks, marks[1:], strict=False)}
    times["feedback to decision"] = (decided - last_feedback).total_seconds()
    times["promoted"] = float("ReleasePromoted" in at)
    return times


def run(
    model_dir: Path, contract: Path, seed: int, home: Path, *, full: bool
) -> tuple[DemoReport, dict[str, float]]:
    settings = Settings(
        home=home,
        model_dir=model_dir,
        postgres_port=free_port(),
        redis_port=free_port(),
        contract_path=contract,
        full_evaluation=full,
        harness_proposals=False,
    )
    stack = LocalStack(settings)
    stack.up(kafka=False)
    try:
        migrate(wiring.database_url(settings))
        started = time.monotonic()
        demo = run_demo(
            settings,
            DemoOptions(
                generations=1,
                turns_per_generation=120,
                concurrency=8,
                out_dir=home / "demo",
                specialists=["genui"],
                seed=seed,
            ),
            step=lambda message: print(f"[{time.monotonic() - started:7.1f} s] {message}"),
        )
        return demo, phases(settings)
    finally:
        stack.down()


HALVES = {"baseline": (CONTRACT_V2, True), "now": (CONTRACT_V2S, False)}
"""Contract v2 in full against contract 2s: the same tasks and checkers, so the halves differ
only by how evaluation runs them (incremental and sequential)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--half", choices=sorted(HALVES), help="run one half here (JSON out)")
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    if args.half:
        contract, full = HALVES[args.half]
        print(f"== {args.half}: {contract.name}, {'every task' if full else 'incremental'}")
        with tempfile.TemporaryDirectory(prefix="macaron-bench-loop-") as scratch:
            demo, times = run(model_dir, contract, args.seed, Path(scratch), full=full)
        _print_demo(demo)
        print(json.dumps(times))
        return
    halves: dict[str, dict[str, float]] = {}
    for half in HALVES:  # a process each: a process's Celery app is configured once
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.loop",
                "--half",
                half,
                "--model",
                str(model_dir),
                "--seed",
                str(args.seed),
            ],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        print(done.stdout, end="")
        halves[half] = json.loads(done.stdout.strip().splitlines()[-1])
    before, now = halves["baseline"], halves["now"]
    targets = {"train": "<= 90 s", "evaluate": "<= 120 s"}
    rows: list[Row] = [
        row(f"phase {phase}", now[phase], "s", before[phase], targets.get(phase, "report"))
        for phase in ("trigger", "train", "evaluate", "decide")
    ]
    total = "feedback to decision"
    rows.append(row(total, now[total], "s", before[total], "<= 300 s"))
    rows.append(row(f"{total}, over the baseline", now[total], "s", before[total], "<= 0.35x"))
    rows += [
        row(f"promoted (1 yes, 0 rejected), {name}", halves[name]["promoted"], "", 1.0, "report")
        for name in ("baseline", "now")
    ]
    report("loop", rows)


def _print_demo(demo: DemoReport) -> None:
    for generation in demo.generations:
        print(
            f"generation {generation.generation}: {generation.release_id} "
            f"({generation.harness_version}) passed {generation.scores} "
            f"well-formed {generation.formats}"
        )
        for record in generation.runs:
            print(f"  run {record.specialist}: {record.outcome}: {'; '.join(record.reasons)}")


if __name__ == "__main__":
    main()
