"""The OpenTelemetry SDK, set up by entry points only (``macaron serve``, ``streams run``,
``worker``, ``demo``); library code records through ``infra.observe`` (the API).

- Spans go where ``MACARON_OTEL_TRACES`` says: ``off`` (ids are still made, so logs and events
  carry them), ``console`` (JSON lines on stderr) or ``otlp`` (OTLP/HTTP to
  ``MACARON_OTEL_ENDPOINT``, the collector).
- Metrics are read by Prometheus: ``metrics_exposition`` is the text of a ``/metrics`` endpoint
  (the chat server serves it on its own port; ``serve_metrics`` gives the processors and the
  workers one on ``MACARON_METRICS_PORT``). Every ``/metrics`` needs a key with the ``metrics``
  scope.
- Logs are JSON lines (``MACARON_LOG_FORMAT=json``) carrying ``trace_id`` and ``span_id``.

The global providers can be set once per process, so the first ``configure_telemetry`` wins.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from core.auth import bearer_key
from core.errors import Forbidden, InvalidApiKey, MacaronError
from core.settings import Settings
from infra.postgres.db import Pool
from infra.postgres.keys import authenticate

_configured = False
_lock = threading.Lock()


def configure_telemetry(
    settings: Settings, service: str, *, exporter: SpanExporter | None = None
) -> bool:
    """Install the tracer and meter providers and the log format for this process; ``exporter``
    (tests: an in-memory one) replaces the configured destination. False when already done."""
    global _configured
    with _lock:
        if _configured:
            return False
        _configured = True
    resource = Resource.create({"service.name": service})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif settings.otel_traces == "console":
        provider.add_span_processor(
            BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr, formatter=_span_line))
        )
    elif settings.otel_traces == "otlp":
        endpoint = settings.otel_endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=[PrometheusMetricReader()])
    )
    if settings.log_format == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
    return True


def _span_line(span: Any) -> str:
    return json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the current span's ids."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = format(span.trace_id, "032x")
            entry["span_id"] = format(span.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# --- /metrics ----------------------------------------------------------------------------------


def metrics_exposition() -> tuple[bytes, str]:
    """The body and content type of a Prometheus scrape of this process."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def authorize_scrape(pool: Pool, authorization: str | None) -> None:
    """Raise a typed error unless the header carries a live key with the ``metrics`` scope."""
    with pool.connection() as conn:
        authenticate(conn, bearer_key(authorization)).require("metrics")


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_wsgi_app(pool: Pool) -> WsgiApp:
    """``GET /metrics`` for a key with the ``metrics`` scope; a JSON error otherwise."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            return _error(start_response, "404 Not Found", "not_found", "only /metrics is here")
        try:
            authorize_scrape(pool, environ.get("HTTP_AUTHORIZATION"))
        except MacaronError as exc:
            return _error(start_response, _status(exc), exc.code, str(exc))
        body, content_type = metrics_exposition()
        start_response("200 OK", [("Content-Type", content_type)])
        return [body]

    return app


def _status(exc: MacaronError) -> str:
    """The HTTP status of a failed scrape, by the error's type."""
    if isinstance(exc, InvalidApiKey):
        return "401 Unauthorized"
    if isinstance(exc, Forbidden):
        return "403 Forbidden"
    return "503 Service Unavailable" if exc.retryable else "500 Internal Server Error"


def _error(
    start_response: Callable[..., Any], status: str, code: str, message: str
) -> Iterable[bytes]:
    start_response(status, [("Content-Type", "application/json")])
    return [json.dumps({"error": {"code": code, "message": message}}).encode()]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return  # scrapes every few seconds would drown the log


def serve_metrics(settings: Settings, pool: Pool, port: int) -> WSGIServer:
    """Serve ``/metrics`` on ``bind_host:port`` in a daemon thread (for the process's life;
    ``shutdown()`` then ``server_close()`` stop it)."""
    server = make_server(
        settings.bind_host, port, metrics_wsgi_app(pool), handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
