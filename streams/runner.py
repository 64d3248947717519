"""The position-tracking host: runs a processor over any ``EventLog`` from its saved positions
(``macaron streams run``). Over Kafka the faust app (``streams.faust_app``) hosts the same
processors."""

from __future__ import annotations

import threading
from collections.abc import Callable

from core.log import RecordedEvent
from streams.host import ProcessorHost

BATCH = 200


def catch_up(host: ProcessorHost, *, batch: int = BATCH) -> int:
    """Process everything stored now; returns how many events were handled."""
    handled = 0
    pending: list[RecordedEvent] = []
    for event in host.log.read(start=host.positions()):
        pending.append(event)
        if len(pending) >= batch:
            host.apply(pending)
            handled += len(pending)
            pending = []
    host.apply(pending)
    return handled + len(pending)


def follow(
    hosts: list[ProcessorHost],
    stop: threading.Event,
    *,
    idle_timeout: float = 0.5,
    on_batch: Callable[[int], None] | None = None,
) -> None:
    """Keep the processors up to date until ``stop`` is set: catch up, then tail the log."""
    while not stop.is_set():
        handled = sum(catch_up(host) for host in hosts)
        if on_batch is not None and handled:
            on_batch(handled)
        if not handled:
            stop.wait(idle_timeout)
