"""The Celery tasks, on ``learners.queue``'s app: ``train_successor`` (queue ``train``, GPU
workers with concurrency 1: ``learners.training.runs`` trains an adapter or proposes a harness),
``evaluate_candidate`` (``eval``, ``learners.evaluation.evaluate``), ``promote`` (``default``),
``sample_rollouts`` (``rollout``: sample, verify and record a rollout job's groups,
``learners.rollouts.job``) and ``train_router`` (``train``: a router successor,
``learners.routing.training``). The evaluation of an adapter run queues a harness proposal for its
specialist, started once the decision took effect. Every task is idempotent by its id, so a
redelivery repeats nothing. Only the composition root builds the runtime (``macaron.wiring``)
and installs it here (``install_runtime``, by ``macaron worker``); the tasks find it there.
"""

from __future__ import annotations

import ctypes
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Task
from celery.exceptions import Reject, Retry
from celery.signals import task_postrun
from opentelemetry.trace import Span
from rich.progress import Progress

from core.errors import EngineWithdrawn, PromotionInProgress
from infra import observe
from infra.postgres.promotions import last_request_of_run, request_promotion, wait_for_request
from infra.postgres.runs import tenants_unlearned
from learners.evaluation.evaluate import evaluate_run
from learners.queue import app, enqueue_training
from learners.rollouts.job import RolloutJob
from learners.rollouts.run import run_rollouts
from learners.routing.run import PROMOTION_TIMEOUT_S, train_router_run
from learners.runtime import RunBusy, Runtime
from learners.training.runs import carry_out_run

_runtime: Runtime | None = None


class _RejectedInOneLine(logging.Filter):
    """Celery logs a rejected task (a rollout job handed back to the queue when its lane stops,
    ``sample_rollouts``) as a warning with its whole traceback; its one line says all there is:
    the task, and why it went back."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info = None
        return True


logging.getLogger("celery.app.trace").addFilter(_RejectedInOneLine())

try:
    _TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere
except (OSError, TypeError):  # no C library to open by name (a static build, Windows)
    _TRIM = None


@task_postrun.connect
def _return_freed_memory(**_: object) -> None:
    """Give the memory a task freed back to the system. glibc keeps freed blocks for reuse, so
    the next task started from the last one's peak: in the self demo's worker an evaluation
    after a training climbed from 3.7 to 5.7 GB. Where the C library has no ``malloc_trim``
    (not glibc), nothing happens."""
    if _TRIM is not None:
        _TRIM(ctypes.c_size_t(0))


def install_runtime(runtime: Runtime) -> None:
    global _runtime
    _runtime = runtime


def runtime() -> Runtime:
    if _runtime is None:
        raise RuntimeError("the worker's runtime was not installed (start it with macaron worker)")
    return _runtime


@contextmanager
def _step(task: Task, step: str, run_id: str) -> Iterator[Span]:
    """The task's span, continuing the trace its headers carry, and its outcome metrics."""
    headers = {
        name: value
        for name in ("traceparent", "tracestate")
        if isinstance(value := task.request.get(name), str)
    }
    started, outcome = time.monotonic(), "failed"
    with observe.tracer.start_as_current_span(
        step, context=observe.context_of(headers), attributes={"macaron.run_id": run_id}
    ) as span:
        try:
            yield span
            outcome = "succeeded"
        except (Retry, Reject):  # back to the queue
            outcome = "retried"
            raise
        finally:
            observe.training_runs.add(1, {"step": step, "outcome": outcome})
            observe.training_duration.record(time.monotonic() - started, {"step": step})


@app.task(bind=True, name="macaron.train_successor")
def train_successor(self: Task, run_id: str) -> str:
    rt = runtime()
    with _step(self, "train_successor", run_id) as span, Progress(transient=True) as bar:
        task = bar.add_task(f"training run {run_id}", total=rt.training.steps)

        def progress(step: int, steps: int, losses: dict[str, float]) -> None:
            bar.update(task, completed=step, total=steps)
            self.update_state(state="PROGRESS", meta={"step": step, "steps": steps, **losses})

        try:
            adapter = carry_out_run(rt, uuid.UUID(run_id), progress)
        except RunBusy as exc:  # a redelivery while the lease of a dead worker runs out
            raise self.retry(
                countdown=rt.settings.training_lease_seconds / 2, max_retries=None
            ) from exc
        span.set_attribute("macaron.adapter", adapter)
        evaluate_candidate.apply_async(
            (run_id,), task_id=f"{run_id}.evaluate", headers=observe.carrier()
        )
    return adapter


@app.task(bind=True, name="macaron.evaluate_candidate")
def evaluate_candidate(self: Task, run_id: str) -> dict[str, Any]:
    with _step(self, "evaluate_candidate", run_id) as span:
        result = evaluate_run(runtime(), uuid.UUID(run_id))
        span.set_attributes(
            {"macaron.passed": result.passed, "macaron.release_id": result.release_id or ""}
        )
        proposal = None if result.proposal is None else str(result.proposal)
        if result.passed and result.release_id is not None:
            promote.apply_async(
                (run_id, result.release_id, proposal),
                task_id=f"{run_id}.promote",
                headers=observe.carrier(),
            )
        elif result.proposal is not None:
            enqueue_training(result.proposal)
    return {
        "passed": result.passed,
        "candidate": result.candidate,
        "parent": result.parent,
        "reasons": result.reasons,
        "release_id": result.release_id,
    }


@app.task(bind=True, name="macaron.promote")
def promote(
    self: Task, run_id: str, release_id: str, proposal: str | None = None
) -> dict[str, Any]:
    """Ask the serving process to promote the run's release and wait for its answer; then
    start ``proposal`` (the harness run queued to follow), against the release then active."""
    with _step(self, "promote", run_id) as span:
        span.set_attribute("macaron.release_id", release_id)
        outcome = _promote(run_id, release_id)
        span.set_attribute("macaron.promotion", str(outcome["status"]))
        if proposal is not None:
            enqueue_training(uuid.UUID(proposal))
    return outcome


@app.task(bind=True, name="macaron.sample_rollouts")
def sample_rollouts(self: Task, job: dict[str, Any]) -> dict[str, Any]:
    """Sample, verify and record a rollout job (refused with ``ValidationError`` when ``job``
    is not one: a malformed message is never retried); a job whose engine was withdrawn (the
    serving process's rollout lane stops) goes back to the queue."""
    checked = RolloutJob.model_validate(job)
    with _step(self, "sample_rollouts", str(checked.job_id)) as span:
        try:
            summary = run_rollouts(runtime(), checked)
        except EngineWithdrawn as exc:
            raise Reject(str(exc), requeue=True) from exc
        span.set_attributes({"macaron.samples": summary.samples, "macaron.passed": summary.passed})
    return summary.model_dump(mode="json")


@app.task(bind=True, name="macaron.train_router")
def train_router(self: Task, run_id: str) -> dict[str, Any]:
    """Train a router successor on the routing labels, judge it on the contract's routing
    suite, and promote a release naming it when it passes (``learners.routing.training``)."""
    with _step(self, "train_router", run_id) as span:
        try:
            outcome = train_router_run(runtime(), uuid.UUID(run_id))
        except (RunBusy, PromotionInProgress) as exc:  # a live lease, or another promotion
            raise self.retry(countdown=15, max_retries=None) from exc
        span.set_attribute("macaron.router_outcome", outcome.status)
    return {
        "status": outcome.status,
        "router_version": outcome.router_version,
        "release_id": outcome.release_id,
    }


def _promote(run_id: str, release_id: str) -> dict[str, Any]:
    rt = runtime()
    with rt.pool.connection() as conn:
        done = last_request_of_run(conn, uuid.UUID(run_id))
        left_out = tenants_unlearned(conn, uuid.UUID(run_id))
    if done is not None and done.status != "failed":
        return {"status": done.status, "reason": done.reason}
    by = f"run {run_id}"
    if left_out:
        by += f", which unlearns {left_out} forgotten tenant(s)"
    request = request_promotion(rt.pool, release_id, run_id=uuid.UUID(run_id), requested_by=by)
    final = wait_for_request(rt.pool, request, PROMOTION_TIMEOUT_S)
    return {"status": final.status, "reason": final.reason}
