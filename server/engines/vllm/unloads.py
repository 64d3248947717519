"""Unloading adapters from the fleet when several servers share it. Each server holds a lease
on every adapter version it loaded and has not let go of (renewed at every health check); a
server that has drained a version lets go of it, and unloads it from the replicas only when no
other server holds it. Otherwise the unload waits, and is tried again at every renewal: the
last server to let go unloads, and a server that died lets go when its leases expire."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

from server.engines.vllm.replica import Replica


class AdapterLeases(Protocol):
    def hold(self, adapters: Iterable[str]) -> None:
        """Hold, or renew, this server's lease on each of ``adapters``."""

    def release(self, adapter: str) -> AbstractContextManager[bool]:
        """Let go of ``adapter``: True when no other server holds it (unload within)."""


class SoleServer:
    """Leases for a fleet no other server shares: every unload goes ahead."""

    def hold(self, adapters: Iterable[str]) -> None:
        return

    @contextlib.contextmanager
    def release(self, adapter: str) -> Iterator[bool]:
        yield True


class Unloads:
    """Unloads on one background thread (callers may be on an event loop), under the fleet's
    admin lock. ``loaded`` tells whether this server serves a name again (then it stays)."""

    def __init__(
        self,
        leases: AdapterLeases,
        replicas: Callable[[], list[Replica]],
        admin: threading.Lock,
        loaded: Callable[[str], bool],
    ) -> None:
        self._leases = leases
        self._replicas = replicas
        self._admin = admin
        self._loaded = loaded
        self._waiting: set[str] = set()  # let go of, held by another server
        self._stopping = threading.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="macaron-fleet-admin")

    def submit(self, work: Callable[..., object], *args: object) -> None:
        """Run ``work`` on the admin thread (the fleet's resynchronisations go there too)."""
        if not self._stopping.is_set():
            with contextlib.suppress(RuntimeError):  # closing meanwhile: nothing to tidy
                self._executor.submit(work, *args)

    def hold(self, adapters: Iterable[str]) -> None:
        self._leases.hold(adapters)

    def renew(self, held: list[str]) -> None:
        """Renew the leases on ``held``; try again each unload another server was holding up."""
        self._leases.hold(held)
        if self._waiting:
            self.submit(self._retry)

    def _retry(self) -> None:
        for name in sorted(self._waiting):  # only this thread changes the set
            self._unload(name)

    def later(self, name: str) -> None:
        """Unload ``name`` once no server holds it."""
        self.submit(self._unload, name)

    def _unload(self, name: str) -> None:
        with self._admin:
            if self._loaded(name):
                self._waiting.discard(name)
                return  # loaded again since: the replicas keep it
            with self._leases.release(name) as last:
                if not last:
                    self._waiting.add(name)
                    return
                self._waiting.discard(name)
                for replica in self._replicas():
                    replica.unload(name)

    def close(self) -> None:
        """Stop taking work; unloads already asked for go out first."""
        self._stopping.set()
        self._executor.shutdown(wait=True)
