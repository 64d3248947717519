"""Unloading adapters from the fleet when several servers share it. Each server holds a lease
on every adapter version it loaded and has not let go of (renewed at every health check); a
server that has drained a version lets go of it, and unloads it from the replicas only when no
other server holds it. Otherwise the unload waits, and is tried again at every renewal: the
last server to let go unloads, and a server that died lets go when its leases expire."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Protocol

from engines.vllm.replica import Replica

log = logging.getLogger(__name__)


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
    admin lock. ``loaded`` tells whether this server serves a name again (then it stays);
    ``held`` is every name it holds. The leases are renewed every ``renew_s`` on a thread of
    their own, never behind the admin lock (a slow load must not let them expire)."""

    def __init__(
        self,
        leases: AdapterLeases,
        replicas: Callable[[], list[Replica]],
        admin: threading.Lock,
        loaded: Callable[[str], bool],
        held: Callable[[], list[str]],
        renew_s: float,
    ) -> None:
        self._leases = leases
        self._replicas = replicas
        self._admin = admin
        self._loaded = loaded
        self._held = held
        self._waiting: set[str] = set()  # let go of, held by another server (or failed)
        self._retrying = threading.Event()  # a retry is queued on the admin thread
        self._stopping = threading.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="macaron-fleet-admin")
        self._renewer = threading.Thread(
            target=self._renew_every, args=(renew_s,), name="macaron-fleet-leases", daemon=True
        )
        self._renewer.start()

    def submit(self, work: Callable[..., object], *args: object) -> None:
        """Run ``work`` on the admin thread (the fleet's resynchronisations go there too)."""
        if not self._stopping.is_set():
            with contextlib.suppress(RuntimeError):  # closing meanwhile: nothing to tidy
                self._executor.submit(work, *args)

    def hold(self, adapters: Iterable[str]) -> None:
        self._leases.hold(adapters)

    def _renew_every(self, interval: float) -> None:
        """Renew this server's leases; try again each unload that waits (another server held
        the name, or the unload failed)."""
        while not self._stopping.wait(interval):
            try:
                self._leases.hold(self._held())
            except Exception:  # the registry is away, say: the next renewal tries again
                log.exception("renewing the fleet's adapter leases failed; trying again")
            if self._waiting and not self._retrying.is_set():
                self._retrying.set()
                self.submit(self._retry)

    def _retry(self) -> None:
        self._retrying.clear()
        for name in sorted(self._waiting):  # only this thread changes the set
            self._unload(name)

    def later(self, name: str) -> None:
        """Unload ``name`` once no server holds it."""
        self.submit(self._unload, name)

    def _unload(self, name: str) -> None:
        try:
            with self._admin:
                if self._loaded(name):
                    self._waiting.discard(name)
                    return  # loaded again since: the replicas keep it
                with self._leases.release(name) as last:
                    self._waiting.add(name)
                    if not last:
                        return
                    for replica in self._replicas():
                        replica.unload(name)
                    self._waiting.discard(name)
        except Exception:  # the registry is away, say: the next renewal tries again
            log.exception("unloading %s from the fleet failed; trying again", name)
            self._waiting.add(name)

    def close(self) -> None:
        """Stop renewing and taking work; unloads already asked for go out first."""
        self._stopping.set()
        self._renewer.join()
        self._executor.shutdown(wait=True)
