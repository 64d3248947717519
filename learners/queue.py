"""The Celery app as producers see it: pointed at the settings' Redis, and the messages they
send, by task name. The tasks themselves are ``learners.worker``'s; a process that only
enqueues (the stream processors, the command line) never imports the training code.

Redis is broker and result backend. Tasks are acknowledged late and rejected when their worker
is lost, so a killed worker's task is given to another after ``task_visibility_timeout``; every
task is idempotent by its id (a run's id, or a rollout job's), so a redelivery repeats nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from celery import Celery

from core.errors import ConfigError
from core.settings import Settings
from infra import observe
from infra.local_stack import LocalStack

if TYPE_CHECKING:
    from learners.rollouts.job import RolloutJob

TRAIN, EVAL, DEFAULT, ROLLOUT = "train", "eval", "default", "rollout"

app = Celery("macaron")
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_default_queue=DEFAULT,
    task_routes={
        "macaron.train_successor": {"queue": TRAIN},
        "macaron.evaluate_candidate": {"queue": EVAL},
        "macaron.promote": {"queue": DEFAULT},
        "macaron.sample_rollouts": {"queue": ROLLOUT},
        "macaron.train_router": {"queue": TRAIN},
    },
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
_configured_url: str | None = None


def redis_url(settings: Settings) -> str:
    return settings.redis_url or LocalStack(settings).redis.url()


def configure(settings: Settings) -> Celery:
    """Point the app at the settings' Redis, once per process: Celery keeps the connections it
    opened, so pointing it elsewhere later would silently send tasks to the first Redis."""
    global _configured_url
    url = redis_url(settings)
    if _configured_url not in (None, url):
        raise ConfigError("the Celery app is already configured for another Redis in this process")
    _configured_url = url
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options={
            "visibility_timeout": settings.task_visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        result_backend_transport_options={"visibility_timeout": settings.task_visibility_timeout},
    )
    return app


def enqueue_training(run_id: uuid.UUID, trace: Mapping[str, str] | None = None) -> None:
    """Enqueue a run's training once (the task id is the run id); ``trace`` (W3C headers) is
    the trace it continues, else the current one."""
    app.send_task(
        "macaron.train_successor",
        (str(run_id),),
        task_id=str(run_id),
        headers=dict(trace or observe.carrier()),
    )


def enqueue_rollouts(job: RolloutJob) -> None:
    """Enqueue a rollout job once (the task id is the job id)."""
    app.send_task(
        "macaron.sample_rollouts",
        (job.model_dump(mode="json"),),
        task_id=str(job.job_id),
        headers=observe.carrier(),
    )


def enqueue_router_training(run_id: uuid.UUID, trace: Mapping[str, str] | None = None) -> None:
    """Enqueue a router run once (the task id is the run id)."""
    app.send_task(
        "macaron.train_router",
        (str(run_id),),
        task_id=str(run_id),
        headers=dict(trace or observe.carrier()),
    )
