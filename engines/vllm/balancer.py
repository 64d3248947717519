"""Which vLLM replica takes the next request: the healthy one with the fewest requests in
flight, ties taken in turn, none past ``max_in_flight``."""

from __future__ import annotations

import itertools
import logging
import threading

from core.errors import EngineOverloaded, EngineUnavailable
from engines.vllm.replica import Replica
from infra import observe

log = logging.getLogger(__name__)


class Balancer:
    """The fleet's replicas with their health and requests in flight, under one lock."""

    def __init__(self, replicas: list[Replica], max_in_flight: int) -> None:
        self.replicas = replicas
        self.max_in_flight = max_in_flight
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def ready(self) -> list[Replica]:
        """The replicas in service now."""
        with self._lock:
            return [r for r in self.replicas if r.healthy]

    def none_ready(self) -> str:
        urls = ", ".join(r.url for r in self.replicas)
        return f"no vLLM replica is in service ({urls}); retry shortly"

    def pick(self, tried: set[Replica]) -> Replica:
        """The healthy replica not yet tried with the fewest requests in flight, counted in."""
        with self._lock:
            ready = [r for r in self.replicas if r.healthy and r not in tried]
            if not ready:
                raise EngineUnavailable(self.none_ready())
            start = next(self._turn) % len(ready)
            best = min(ready[start:] + ready[:start], key=lambda r: r.in_flight)
            if best.in_flight >= self.max_in_flight:
                raise EngineOverloaded(
                    f"every vLLM replica has {self.max_in_flight} requests in flight; retry shortly"
                )
            best.in_flight += 1
            best.requests += 1
            return best

    def done(self, replica: Replica) -> None:
        """A request ``pick`` counted in has ended."""
        with self._lock:
            replica.in_flight -= 1

    def set_health(self, replica: Replica, up: bool, reason: object = None) -> None:
        """Record what a health check found, logging a replica that enters or leaves service."""
        with self._lock:
            if up and not replica.healthy:
                log.info("vLLM replica %s is in service", replica.url)
            if not up and replica.healthy:
                log.warning("vLLM replica %s is out of service: %s", replica.url, reason)
            replica.healthy = up

    def mark_down(self, replica: Replica, reason: object) -> None:
        """Take a replica that failed a request out of service until a health check passes."""
        with self._lock:
            if replica.healthy:
                log.warning("vLLM replica %s failed a request: %s", replica.url, reason)
            replica.healthy = False
        self.count_in_service()

    def count_in_service(self) -> None:
        observe.replicas_in_service.set(sum(r.healthy for r in self.replicas))
