"""What library code uses to be observed: the OpenTelemetry API only, never the SDK.

Spans come from ``tracer``; the trace context crosses process boundaries as W3C headers
(``carrier`` writes them, ``context_of`` and ``link_of`` read them): in the ``trace`` field of
every event, and in Celery task headers. The instruments below are the metrics every process
may record; ``infra.telemetry`` (entry points only) decides where spans and metrics go. Until an
entry point configures the SDK, all of this costs next to nothing and records nothing.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context

from core.errors import MacaronError

_log = logging.getLogger(__name__)
tracer = trace.get_tracer("macaron")
_meter = metrics.get_meter("macaron")

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LONG_SECONDS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


def carrier() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``, ``tracestate``); empty
    outside a recorded span."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def context_of(headers: Mapping[str, str] | None) -> Context:
    """The context the headers carry (an empty one when they carry none): start a span in it
    to continue their trace."""
    return propagate.extract(dict(headers or {}))


def link_of(headers: Mapping[str, str] | None) -> trace.Link | None:
    """A span link to the span the headers name, for work that comes from many traces."""
    span = trace.get_current_span(context_of(headers)).get_span_context()
    return trace.Link(span) if span.is_valid else None


# --- the metrics ---------------------------------------------------------------------------

turns = _meter.create_counter(
    "macaron.turns", unit="1", description="Turns answered, by front end and outcome"
)
errors = _meter.create_counter(
    "macaron.errors", unit="1", description="Errors answered to clients, by stable code"
)
turn_latency = _meter.create_histogram(
    "macaron.turn.duration",
    unit="s",
    description="Turn latency, receipt to durable completion",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
time_to_first_token = _meter.create_histogram(
    "macaron.turn.time_to_first_token",
    unit="s",
    description="Time to the first token",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
tokens = _meter.create_counter(
    "macaron.tokens.generated", unit="1", description="Tokens generated (rate: tokens/s)"
)
router_decisions = _meter.create_counter(
    "macaron.router.decisions", unit="1", description="Router decisions, by specialist"
)
processor_events = _meter.create_counter(
    "macaron.processor.events", unit="1", description="Events handled, by processor"
)
training_runs = _meter.create_counter(
    "macaron.training.runs", unit="1", description="Learning-loop tasks, by step and outcome"
)
training_duration = _meter.create_histogram(
    "macaron.training.duration",
    unit="s",
    description="Learning-loop task duration, by step",
    explicit_bucket_boundaries_advisory=_LONG_SECONDS,
)
promotions = _meter.create_counter(
    "macaron.promotions", unit="1", description="Promotions and rollbacks carried out, by kind"
)
engine_in_flight = _meter.create_up_down_counter(
    "macaron.engine.in_flight",
    unit="1",
    description="Generation requests submitted to the engine and not yet finished (its queue)",
)
adapters_loaded = _meter.create_gauge(
    "macaron.engine.adapters_loaded", unit="1", description="Adapters the serving engine holds"
)
replicas_in_service = _meter.create_gauge(
    "macaron.engine.replicas_in_service",
    unit="1",
    description="vLLM replicas the fleet engine sends requests to (healthy, adapters in place)",
)
replica_failovers = _meter.create_counter(
    "macaron.engine.replica_failovers",
    unit="1",
    description="Requests sent to another vLLM replica after one failed before the first token",
)

prefix_cache_hits = _meter.create_counter(
    "macaron.engine.prefix_cache.hits",
    unit="1",
    description="Prompts the local engine began from a cached prefix",
)
prefix_cache_evictions = _meter.create_counter(
    "macaron.engine.prefix_cache.evictions",
    unit="1",
    description="Cached prompt prefixes evicted by the local engine to stay within its cap",
)


class Lagging(Protocol):
    """A stream processor host as the lag gauge sees it."""

    @property
    def name(self) -> str: ...

    def lag(self) -> int:
        """Events stored in the log that the processor has not handled yet."""
        ...


_hosts: weakref.WeakSet[Lagging] = weakref.WeakSet()


def watch_lag(host: Lagging) -> None:
    """Report ``host``'s lag at every collection while it lives."""
    _hosts.add(host)


def _lag(_options: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
    for host in list(_hosts):
        try:
            yield metrics.Observation(host.lag(), {"processor": host.name})
        except MacaronError as exc:  # the log or the database is away: no figure this time
            _log.warning("no lag figure for %s: %s", host.name, exc)


_meter.create_observable_gauge(
    "macaron.processor.lag",
    callbacks=[_lag],
    unit="1",
    description="Events in the log not yet handled, by processor",
)
