"""What became of a training run, read from the registry and from the worker's task results:
the worker's tasks have ids derived from the run id, so a task that raised is found by it."""

from __future__ import annotations

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
        row = run_verdicts(conn, run_id)
    if row is None:
        raise DemoFailed(f"run {run_id} was listed but is gone from training_runs")
    scores: dict[str, Any] = row["scores"] or {}
    seconds = row["metrics"].get("seconds")

    formats: dict[str, Any] = scores.get("formats", {})
    recipe = str(row["recipe"])

    def decided(outcome: str, reasons: list[str]) -> RunRecord:
        return RunRecord(
            str(run_id),
            row["specialist"],
            str(row["kind"]),
            recipe,
            outcome,
            bool(row["passed"]),
            None if seconds is None else float(seconds),
            scores.get("candidate", {}),
            scores.get("parent", {}),
            reasons,
            formats.get("candidate", {}),
            formats.get("parent", {}),
            scores.get("p_value"),
            scores.get("guard_p_values", {}),
        )

    failure = _task_failure(str(run_id))
    if row["status"] == "failed" or (row["status"] != "succeeded" and failure is not None):
        return decided("training failed", [row["error"] or failure or "unknown"])
    if row["status"] != "succeeded":
        return None
    if row["passed"] is None:
        failure = _task_failure(f"{run_id}.evaluate")
        return None if failure is None else decided("evaluation failed", [failure])
    if not row["passed"]:
        return decided("rejected", list(scores.get("reasons", [])))
    if row["promotion"] == "promoted":
        return decided("promoted", [])
    if row["promotion"] == "rejected":
        return decided("promotion refused", [row["promotion_reason"]])
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
        row = training_run(conn, run_id)
    status = "unknown" if row is None else str(row["status"])
    return {"succeeded": "trained: evaluating and deciding"}.get(status, status)
