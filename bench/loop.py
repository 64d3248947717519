"""One generation of the learning loop end to end on SmolLM2-135M, each phase timed.

The demo's path (`macaron demo --generations 1 --specialists genui`): simulated GenUI users
whose oracle sends feedback, the trigger, the snapshot, the CPU recipe in a Celery worker, the
contract (v2, the default; --contract v1 for v1) on the parent and the candidate, promotion or
rejection; on a fresh local stack (embedded PostgreSQL and Redis on free ports) in a temporary
MACARON_HOME. Harness proposals are off, so the generation is the one adapter run.

Phases, from the timestamps of the run's events in the log:
  trigger   the feedback that completed the trigger's count -> TrainingRequested (snapshot taken)
  train     TrainingRequested -> CandidateTrained
  evaluate  CandidateTrained -> ContractEvaluated
  decide    ContractEvaluated -> ReleasePromoted or PromotionRejected
Target (issue 18): feedback to promotion <= 10 minutes on this CPU.

Baseline: the code path before issue 18's work cannot run in the same process; the baseline
column holds the phases of the demo measured on 2026-11-30 before the shared training prefix
and the prefix cache (genui, seed 0: train 386 s, evaluate 784 s), labelled so.

Usage: python -m bench.loop [--model PATH] [--contract v1|v2] [--seed N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import Row, report, row
from core.settings import Settings, default_home
from infra.local_stack import LocalStack, free_port
from infra.models import pull_model
from infra.postgres.migrate import migrate
from learners.contract_runner import CONTRACT_V1, CONTRACT_V2
from macaron import wiring
from macaron.demo.generations import run_demo
from macaron.demo.records import DemoReport

BASE_MODEL = "smollm2-135m-instruct"
BEFORE = {"train": 386.0, "evaluate": 784.0}  # the stop-24 demo's genui run, seconds
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
    model_dir: Path, contract: Path, seed: int, home: Path
) -> tuple[DemoReport, dict[str, float]]:
    settings = Settings(
        home=home,
        model_dir=model_dir,
        postgres_port=free_port(),
        redis_port=free_port(),
        contract_path=contract,
        harness_proposals=False,
    )
    stack = LocalStack(settings)
    stack.up(kafka=False)
    try:
        migrate(wiring.database_url(settings))
        started = time.monotonic()
        demo = run_demo(
            settings,
            generations=1,
            turns_per_generation=120,
            concurrency=8,
            out_dir=home / "demo",
            specialists=["genui"],
            seed=seed,
            step=lambda message: print(f"[{time.monotonic() - started:7.1f} s] {message}"),
        )
        return demo, phases(settings)
    finally:
        stack.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--contract", choices=["v1", "v2"], default="v2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    contract = CONTRACT_V2 if args.contract == "v2" else CONTRACT_V1
    with tempfile.TemporaryDirectory(prefix="macaron-bench-loop-") as scratch:
        demo, times = run(model_dir, contract, args.seed, Path(scratch))
    for generation in demo.generations:
        print(
            f"generation {generation.generation}: {generation.release_id} "
            f"({generation.harness_version}) passed {generation.scores} "
            f"well-formed {generation.formats}"
        )
        for record in generation.runs:
            print(f"  run {record.specialist}: {record.outcome}: {'; '.join(record.reasons)}")
    label = {"train": "train", "evaluate": f"evaluate, contract {args.contract}"}
    rows: list[Row] = [
        row(
            f"phase {label.get(name, name)}"
            + (" (baseline: stop-24 demo)" if name in BEFORE else ""),
            times[name],
            "s",
            BEFORE.get(name, times[name]),
            "report",
        )
        for name in ("trigger", "train", "evaluate", "decide")
    ]
    total = times["feedback to decision"]
    rows.append(row("feedback to decision", total, "s", sum(BEFORE.values()), "<= 600 s"))
    rows.append(row("promoted (1 yes, 0 rejected)", times["promoted"], "", 1.0, "report"))
    report("loop" if args.contract == "v2" else "loop-v1", rows)


if __name__ == "__main__":
    main()
