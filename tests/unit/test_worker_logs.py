"""How the Celery worker's log reads a task that went back to the queue, through Celery's own
tracer (the code that runs a task in a worker and logs its end)."""

from __future__ import annotations

import logging
import uuid

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Reject

import learners.worker  # noqa: F401 (installs the worker's log filter)


def _trace(error: Exception) -> None:
    app = Celery("worker-logs", set_as_current=False)

    def fails() -> None:
        raise error

    task = app.task(name="fails")(fails)
    build_tracer("fails", task, app=app, store_errors=False)(str(uuid.uuid4()), (), {})


def test_a_rejected_task_is_logged_in_one_line_without_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="celery.app.trace")
    _trace(Reject("the background view of the engine was closed", requeue=True))
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "the background view of the engine was closed" in record.getMessage()
    assert record.exc_info is None


def test_a_failed_task_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="celery.app.trace")
    _trace(ValueError("a real failure"))
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)
