"""Tracing, metrics and logs across the turn, the log, the processors and Celery.

One user turn over the WebSocket (and the feedback on it) must make one trace: the server's
spans and the processors' in this process (in-memory exporter), and the Celery task's in a real
``macaron worker`` process, which writes its spans to stderr (``MACARON_OTEL_TRACES=console``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from core.settings import Settings
from infra.local_stack import free_port
from infra.telemetry import JsonFormatter, serve_metrics
from learners.queue import app as celery_app
from learners.queue import configure as configure_celery
from macaron import wiring
from macaron.demo import worker_environment
from server.router import RouterService
from tests.factories import run_macaron
from tests.serving import following, frames_until, running_server, send

DATA = Path(__file__).resolve().parents[1] / "data"
ANSWER = '{"type": "Text", "text": "green"}'
SERVER_SPANS = {
    "ws.turn",
    "router.decide",
    "harness.context",
    "engine.generate",
    "log.append",
    "ws.feedback",
}


@pytest.fixture
def traced_settings(
    database_url: str, celery_redis_url: str, tiny_model: Path, tmp_path: Path
) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=1,
        contract_path=DATA / "contract-e2e.yaml",
        training_config=DATA / "training-e2e.yaml",
        task_visibility_timeout=120,
        max_new_tokens=16,
        log_format="text",
    )


@pytest.fixture
def console_worker(traced_settings: Settings, tmp_path: Path) -> Iterator[Path]:
    """A ``macaron worker`` on the train queue only, printing its spans; its log's path."""
    env = worker_environment(traced_settings)
    env["MACARON_OTEL_TRACES"] = "console"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "macaron", "worker", "--queues", "train"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield log_path
        finally:
            process.terminate()
            process.wait(timeout=60)
            with celery_app.connection_for_write() as conn:  # the evaluation nobody took
                conn.default_channel.queue_purge("eval")


def test_one_turn_makes_one_trace_through_processors_and_celery(
    traced_settings: Settings,
    router: RouterService,
    spans: InMemorySpanExporter,
    console_worker: Path,
) -> None:
    configure_celery(traced_settings)
    spans.clear()
    with running_server(traced_settings, router=router) as served, following(served):
        with served.connect(served.key("acme")) as ws:
            frames_until(ws, "ready")
            send(
                ws,
                type="user_turn",
                client_msg_id="m1",
                content="Show the status.",
                specialist_hint="genui",
            )
            turn_id = frames_until(ws, "turn_completed")[-1]["turn_id"]
            send(ws, type="feedback", turn_id=turn_id, kind="edit", edited_text=ANSWER)
            send(ws, type="ping")
            frames_until(ws, "pong")
        task = worker_span(console_worker, "train_successor")

    local = spans.get_finished_spans()
    [root] = [s for s in local if s.name == "ws.turn"]
    assert root.parent is None and root.attributes is not None
    assert root.attributes["macaron.turn_id"] == turn_id
    trace_id = root.context.trace_id
    in_trace = [s for s in local if s.context.trace_id == trace_id]
    names = {s.name for s in in_trace}
    assert names >= SERVER_SPANS, names
    processor_spans = {n for n in names if n.startswith("processor.")}
    assert {"processor.experience", "processor.training-trigger-1"} <= processor_spans
    [generate] = [s for s in in_trace if s.name == "engine.generate"]
    assert generate.attributes is not None
    assert int(str(generate.attributes["macaron.tokens"])) > 0
    assert "macaron.time_to_first_token_ms" in generate.attributes

    # An operator finds the trace from the turn id.
    db = {
        "MACARON_DATABASE_URL": traced_settings.database_url or "",
        "MACARON_HOME": str(traced_settings.home),  # its master key opens the log
    }
    found = run_macaron("trace", turn_id, **db)
    assert found.returncode == 0, found.stderr
    assert f"trace_id {trace_id:032x}" in found.stdout
    unknown = run_macaron("trace", str(uuid.uuid4()), **db)
    assert unknown.returncode == 1 and "[turn_not_found]" in unknown.stderr

    # The Celery task, in another process, continues the trace under the trigger's span ...
    assert task["context"]["trace_id"] == f"0x{trace_id:032x}"
    trigger_ids = {
        f"0x{s.context.span_id:016x}" for s in in_trace if s.name == "processor.training-trigger-1"
    }
    assert task["parent_id"] in trigger_ids
    assert task["attributes"]["macaron.run_id"]
    # ... and links the turns whose experience it trained on.
    assert {link["context"]["trace_id"] for link in task["links"]} == {f"0x{trace_id:032x}"}


def worker_span(log: Path, name: str, timeout: float = 180) -> dict[str, Any]:
    """The first span called ``name`` the worker printed (console exporter: JSON lines)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"name":"{name}"' in line:
                span: dict[str, Any] = json.loads(line)
                return span
        time.sleep(1)
    raise AssertionError(f"no {name} span from the worker:\n{log.read_text()[-4000:]}")


def scrape(url: str, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(url, headers=headers, timeout=10)


def turns_counted(text: str) -> float:
    """The turns counter's total (absent until a first turn is counted)."""
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "macaron_turns"
        for s in f.samples
        if s.name.endswith("_total")
    )


def test_metrics_count_the_turn_and_need_the_metrics_scope(
    traced_settings: Settings, router: RouterService, spans: InMemorySpanExporter
) -> None:
    with running_server(traced_settings, router=router) as served:
        url, key = f"{served.http}/metrics", served.key("ops", "metrics")
        assert scrape(url, None).status_code == 401
        assert scrape(url, served.key("acme")).status_code == 403  # a chat key
        before = turns_counted(scrape(url, key).text)
        with served.connect(served.key("acme")) as ws:
            frames_until(ws, "ready")
            send(ws, type="user_turn", client_msg_id="m1", content="hello")
            frames_until(ws, "turn_completed")
        response = scrape(url, key)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        assert turns_counted(response.text) == before + 1
        families = {f.name for f in text_string_to_metric_families(response.text)}
        assert {
            "macaron_turn_duration_seconds",
            "macaron_turn_time_to_first_token_seconds",
            "macaron_router_decisions",
            "macaron_tokens_generated",
            "macaron_engine_in_flight",
            "macaron_engine_adapters_loaded",
        } <= families

        # The processors' and workers' endpoint: same scope rule, their own port.
        port = free_port()
        server = serve_metrics(traced_settings, served.server.pool, port)
        try:
            hosts = wiring.processor_hosts(traced_settings, served.server.log, served.server.pool)
            own = f"http://127.0.0.1:{port}/metrics"
            assert scrape(own, served.key("acme")).status_code == 403
            text = scrape(own, key).text
            [family] = [
                f for f in text_string_to_metric_families(text) if f.name == "macaron_processor_lag"
            ]
            lag = {s.labels["processor"]: s.value for s in family.samples}
            assert lag and all(value > 0 for value in lag.values())  # nothing handled yet
            assert {h.name for h in hosts} <= lag.keys()
            assert scrape(f"http://127.0.0.1:{port}/other", key).status_code == 404
        finally:
            server.shutdown()
            server.server_close()


def test_json_logs_carry_the_current_trace(spans: InMemorySpanExporter) -> None:
    record = logging.LogRecord(
        "macaron.test", logging.INFO, __file__, 1, "hello %s", ("you",), None
    )
    outside = json.loads(JsonFormatter().format(record))
    assert outside["message"] == "hello you" and "trace_id" not in outside
    with trace.get_tracer("test").start_as_current_span("work") as span:
        inside = json.loads(JsonFormatter().format(record))
    context = span.get_span_context()
    assert inside["trace_id"] == f"{context.trace_id:032x}"
    assert inside["span_id"] == f"{context.span_id:016x}"
