"""Build adapters from settings. The only place that decides which adapter serves a port.

The serving and training parts (engines, the router, the trainer) load torch, so they are
imported by the functions that build them: the commands that only read the database or the
log start in about a second."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import uuid4

from core.engine import Engine
from core.errors import ModelUnavailable
from core.events.privacy import Cipher
from core.log import EventLog
from core.routing import RouterNotFound
from core.settings import Settings
from infra.artifacts import ArtifactStore
from infra.kafka.eventlog import KafkaEventLog
from infra.local_stack import LocalStack
from infra.master_key import load_master_keys
from infra.models import models_dir
from infra.postgres.data_keys import PostgresDataKeys, wrapping_master_ids
from infra.postgres.db import Pool, open_pool
from infra.postgres.eventlog import PostgresEventLog
from infra.postgres.routers import queued_router_run_ids, register_router, router_model
from infra.postgres.run_registry import PostgresRunRegistry
from infra.postgres.runs import queued_run_ids
from learners.queue import enqueue_router_training, enqueue_training
from streams.experience_rules import ExperienceBuilder
from streams.host import ProcessorHost
from streams.processor import Processor
from streams.projections import Projections
from streams.router_trigger import RouterTrigger
from streams.scores import LiveScores
from streams.trigger import TrainingTrigger
from streams.unlearning_dispatch import UnlearningDispatcher

_log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the serving and training parts load torch: imported where they are built
    from starlette.applications import Starlette

    from core.release import Release
    from engines.shared import SharedEngine
    from learners.rollouts.lane import RolloutLane
    from learners.runtime import Runtime
    from server.chat import ChatService
    from server.router import RouterService, SentenceEmbedder
    from server.turns.request import Router


def database_url(settings: Settings) -> str:
    return settings.database_url or LocalStack(settings).postgres.url()


def data_keys(settings: Settings, pool: Pool) -> PostgresDataKeys:
    """Tenants' data keys, wrapped by the master key file; a master key that is not the one
    the stored keys were wrapped with refuses start-up here."""
    keys = PostgresDataKeys(pool, load_master_keys(settings, wrapping_master_ids(pool)))
    keys.check_master()
    return keys


def cipher(settings: Settings, pool: Pool) -> Cipher:
    return Cipher(data_keys(settings, pool))


def event_log(settings: Settings, pool: Pool, keys: PostgresDataKeys | None = None) -> EventLog:
    """The log, sealing and opening tenants' words with their data keys (``keys``: the ones
    this process forgets with, so a forgotten tenant stops opening here at once)."""
    sealing = Cipher(keys or data_keys(settings, pool))
    if settings.event_log == "kafka":
        return KafkaEventLog(settings.kafka_servers, settings.kafka_topic, pool, sealing)
    return PostgresEventLog(pool, database_url(settings), sealing)


def pool(settings: Settings) -> Pool:
    return open_pool(database_url(settings))


LANE_SLOTS = 12
"""Requests the rollout lane may hold in flight on the serving engine (the local engine batches
16: a chat turn always finds room beside them)."""
LANE_REJECT_S = 5.0
"""How long a closing server waits, after shutting its engine down, for the lane to reject a job
that outlived its stop back to the queue."""


@dataclass
class Server:
    """The chat server's parts, wired; ``close`` releases them in reverse order."""

    app: Starlette
    chat: ChatService
    engine: SharedEngine
    log: EventLog
    pool: Pool
    lane: RolloutLane | None = None

    def serve_rollouts(self, settings: Settings) -> None:
        """Take rollout jobs from the Celery queue (``learners.rollouts.lane``) and sample them on
        this server's engine when chat leaves it idle; Celery must be configured."""
        from learners.rollouts.lane import RolloutLane

        runtime = learning_runtime(settings, self.pool)
        self.lane = RolloutLane(runtime, lambda: self.engine.background(LANE_SLOTS))
        try:
            self.lane.start()
        except BaseException:
            runtime.log.close()
            self.lane = None
            raise

    def close(self) -> None:
        stopped = self.lane is None or self.lane.stop()
        self.engine.close()
        if self.lane is not None:
            if not stopped:  # the job's request, withdrawn as the engine closed, is rejected
                self.lane.stop(LANE_REJECT_S)
            self.lane.runtime.log.close()
        self.log.close()
        self.pool.close()


def model_dir(settings: Settings) -> Path:
    """The base model's folder; for the local engine, checked to be a family it serves with a
    chat template before anything else starts (``engines.local.base_model``)."""
    folder = settings.model_dir or models_dir(settings.home) / "smollm2-135m-instruct"
    if not (folder / "config.json").is_file():
        raise ModelUnavailable(
            f"no base model at {folder}: run `macaron model pull` or set MACARON_MODEL_DIR"
        )
    if settings.engine == "local":
        from engines.local.base_model import check_base_model

        check_base_model(folder)
    return folder


def learning_runtime(settings: Settings, pool: Pool) -> Runtime:
    """What the learning loop's tasks run with; the contract runs on the kind of engine that
    serves (this process's own, or the vLLM fleet, which the evaluation shares with the
    server: it unloads the candidates it loaded when it is done). The local contract engine
    runs float32 whatever the served dtype, so that outcomes recorded for one release compare
    with another's."""
    from learners.evaluation.contract_runner import DEFAULT_CONTRACT
    from learners.recipes.config import DEFAULT_CONFIG, load_config
    from learners.routing.training import ClassifierTrainer
    from learners.runtime import Runtime
    from server.router import SentenceEmbedder

    folder = model_dir(settings)
    return Runtime(
        settings=settings,
        pool=pool,
        runs=PostgresRunRegistry(pool),
        log=event_log(settings, pool),
        store=ArtifactStore(settings.home / "adapters"),
        model_dir=folder,
        training=load_config(settings.training_config or DEFAULT_CONFIG),
        contract_path=settings.contract_path or DEFAULT_CONTRACT,
        contract_engine=lambda: serving_engine(
            settings.model_copy(update={"dtype": "float32"}), folder, lambda _: None, pool
        ),
        router_trainer=lambda: ClassifierTrainer.from_seed(SentenceEmbedder()),
    )


def seed_router(embedder: SentenceEmbedder | None = None) -> RouterService:
    """The router the server starts with: the classifier of the seed examples, on
    ``embedder``'s features (a fresh embedder if none); it retrains with
    ``learners.routing.training``'s trainer."""
    from learners.routing.training import ClassifierTrainer
    from server.router import RouterService, SentenceEmbedder

    features = embedder if embedder is not None else SentenceEmbedder()
    trainer = ClassifierTrainer.from_seed(features)
    return RouterService(features, trainer, trainer.seed_model())


def serving_engine(
    settings: Settings, folder: Path, step: Callable[[str], None], db: Pool | None
) -> Engine:
    """The engine ``macaron serve`` answers with: this process's own, or the vLLM fleet (with
    leases on its adapters in ``db``'s registry, when given: other servers may share it)."""
    from engines.local.engine import LocalEngine
    from engines.vllm.fleet import FleetEngine, FleetOptions
    from infra.hardware import native_dtype
    from infra.postgres.leases import PostgresAdapterLeases

    if settings.engine == "vllm":
        step(f"connecting to the vLLM fleet at {settings.vllm_urls}")
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid4().hex[:8]}"
        return FleetEngine(
            settings.vllm_replicas,
            folder,
            FleetOptions(max_lora_rank=settings.vllm_max_lora_rank),
            leases=None if db is None else PostgresAdapterLeases(db, holder),
        )
    dtype = native_dtype(settings.dtype)
    step(f"loading the base model from {folder} ({settings.dtype})")
    return LocalEngine(folder, dtype=dtype)


def chat_server(
    settings: Settings,
    step: Callable[[str], None],
    *,
    engine: Engine | None = None,
    router: Router | None = None,
    log: EventLog | None = None,
) -> Server:
    """Everything ``macaron serve`` runs: engine, router, log, registry, the root release.
    Benchmarks and tests may bring their own engine, router or log."""
    from core.release import ServedRelease
    from engines.shared import SharedEngine
    from server.chat import ChatService
    from server.entrypoints.app import create_app
    from server.entrypoints.gate import Gate
    from server.promotion import PromotionListener
    from server.releases import ensure_root_release, prepare_release
    from server.router import RouterService
    from server.turns.rate import MEMORY
    from server.turns.request import ChatLimits

    folder = model_dir(settings)
    if engine is None and settings.engine == "local":
        from infra.hardware import native_dtype

        native_dtype(settings.dtype)  # refused before anything starts
    step("connecting to PostgreSQL")
    db = pool(settings)
    keys = data_keys(settings, db)
    log = log or event_log(settings, db, keys)
    shared = SharedEngine(engine or serving_engine(settings, folder, step, db))
    if router is None:
        step("training the router from its seed examples")
        router = seed_router()
    step("loading the active release")
    store = ArtifactStore(settings.home / "adapters")
    release = ensure_root_release(db, log, store, folder, router.version, router.specialists)
    harness = prepare_release(shared, store, db, release)
    if isinstance(router, RouterService):
        serve_router_of(db, release, router)
    limits = ChatLimits(
        turns_per_minute=settings.turns_per_minute, max_new_tokens=settings.max_new_tokens
    )
    # Counted in Redis when one is configured, so replicas share each key's limit.
    rate_storage = settings.redis_url or MEMORY
    served = ServedRelease(release=release, harness=harness)
    chat = ChatService(log, shared, router, served, limits=limits, rate_storage=rate_storage)
    gate = Gate(db, max_connections_per_tenant=settings.max_connections_per_tenant)
    listener = PromotionListener(chat, db, store, log)
    app = create_app(chat, gate, listener, keys)
    return Server(app, chat, shared, log, db)


def serve_router_of(db: Pool, release: Release, router: RouterService) -> None:
    """Register the router's classifier; route with the one ``release`` names if that is
    another (a promoted router version). A release from before router versions were stored
    keeps the seed router, with a warning."""
    with db.connection() as conn, conn.transaction():
        register_router(conn, router.model, parent=None)
        if release.router_version == router.version:
            return
        try:
            router.serve_model(router_model(conn, release.router_version))
        except RouterNotFound:
            _log.warning(
                "release %s names router %s, which the registry does not hold: routing with %s",
                release.release_id,
                release.router_version,
                router.version,
            )


def processor_hosts(settings: Settings, log: EventLog, pool: Pool) -> list[ProcessorHost]:
    """The stream processors, each in its host; the trigger enqueues training runs."""
    processors: list[Processor] = [
        Projections(),
        ExperienceBuilder(data_keys(settings, pool), settings.experience_filter),
        LiveScores(),
        TrainingTrigger(settings.train_threshold, enqueue_training, log),
        UnlearningDispatcher(enqueue_training, enqueue_router_training),
    ]
    if settings.router_threshold:
        processors.append(RouterTrigger(settings.router_threshold, enqueue_router_training))
    return [ProcessorHost(p, log, pool) for p in processors]


def enqueue_queued_runs(pool: Pool) -> None:
    """Enqueue every run still queued, adapter and router runs: the triggers enqueue after
    their commit, and a crash in between must not strand a run (enqueueing twice is harmless:
    the task id is the run id)."""
    with pool.connection() as conn:
        run_ids = queued_run_ids(conn)
        router_run_ids = queued_router_run_ids(conn)
    for run_id in run_ids:
        enqueue_training(run_id)
    for run_id in router_run_ids:
        enqueue_router_training(run_id)
