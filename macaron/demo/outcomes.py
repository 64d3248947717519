"""What became of a training run, read from the registry and from the worker's task results:
the worker's tasks have ids derived from the run id, so a task that raised is found by it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

from infra.postgres.db import Pool
from infra.postgres.lookups import run_verdicts
from infra.postgres.runs import training_run
from learners.queue import app as celery_app
from macaron.demo.records import DemoFailed, RunRecord


def run_outcome(pool: Pool, run_id: UUID) -> RunRecord | None:
    """What became of the run, or ``None`` while it is still being trained or decided."""
    with pool.connection() as conn:
        verdicts = run_verdicts(conn, run_id)
    if verdicts is None:
        raise DemoFailed(f"run {run_id} was listed but is gone from training_runs")
    run = verdicts.run
    scores: Mapping[str, Any] = verdicts.scores or {}
    seconds = run.metrics.get("seconds")
    formats: Mapping[str, Any] = scores.get("formats", {})
    calls: Mapping[str, Any] = scores.get("calls", {})

    def decided(outcome: str, reasons: list[str]) -> RunRecord:
        return RunRecord(
            str(run_id),
            run.specialist,
            run.kind,
            run.recipe,
            outcome,
            bool(verdicts.passed),
            None if seconds is None else float(seconds),
            scores.get("candidate", {}),
            scores.get("parent", {}),
            reasons,
            formats.get("candidate", {}),
            formats.get("parent", {}),
            scores.get("p_value"),
            scores.get("guard_p_values", {}),
            calls.get("candidate", {}),
            calls.get("parent", {}),
        )

    failure = _task_failure(str(run_id))
    if run.status == "failed" or (run.status != "succeeded" and failure is not None):
        return decided("training failed", [run.error or failure or "unknown"])
    if run.status != "succeeded":
        return None
    if verdicts.passed is None:
        failure = _task_failure(f"{run_id}.evaluate")
        return None if failure is None else decided("evaluation failed", [failure])
    if not verdicts.passed:
        return decided("rejected", list(scores.get("reasons", [])))
    if verdicts.promotion == "promoted":
        return decided("promoted", [])
    if verdicts.promotion == "rejected":
        return decided("promotion refused", [verdicts.promotion_reason or ""])
    failure = _task_failure(f"{run_id}.promote")
    return None if failure is None else decided("promotion failed", [failure])


def _task_failure(task_id: str) -> str | None:
    """The error of a worker task that failed (its id is derived from the run id), if any."""
    result = celery_app.AsyncResult(task_id)
    return repr(result.result) if result.state == "FAILURE" else None


def run_progress(pool: Pool, run_id: UUID) -> str:
    """Where the run stands, for the progress line: its training step, else its status."""
    result = celery_app.AsyncResult(str(run_id))
    info = result.info
    if result.state == "PROGRESS" and isinstance(info, dict):
        return f"training: step {info.get('step')} of {info.get('steps')}"
    with pool.connection() as conn:
        run = training_run(conn, run_id)
    status = "unknown" if run is None else run.status
    return {"succeeded": "trained: evaluating and deciding"}.get(status, status)
