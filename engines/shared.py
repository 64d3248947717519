"""One engine, two kinds of traffic: chat in the foreground, and background work (the rollout
lane, ``learners.rollouts.lane``) on the capacity chat leaves idle.

``SharedEngine`` is the engine as chat sees it: it counts the chat requests in flight.
``background()`` is the engine as the lane sees it: a request starts only when no chat request
has been in flight for ``QUIET_S``, and at most ``slots`` background requests are in flight at
once, so a turn that arrives meanwhile joins the batch beside them instead of queueing behind
them (the local engine batches 16). Its ``close`` closes the view, not the engine: the server
owns the engine; requests the closed view is asked for fail with ``EngineWithdrawn``, and so do
those it still runs if the server then shuts the engine down under them.

A view pins the adapters it loads or samples with until it is closed: chat unloading one (the
release it served was replaced) is deferred until no open view holds it, so a job never loses
its adapter between two requests.

Requests may come from several event loops (the server's and the lane's thread): the counts
are guarded by a thread lock, and a waiting request polls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator
from contextlib import aclosing

from core.engine import Engine, GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import EngineUnavailable, EngineWithdrawn

QUIET_S = 0.2
"""How long the engine must have served no chat before a background request starts."""
POLL_S = 0.02


class SharedEngine:
    """``engine`` for chat: every method delegates; ``generate`` counts its stream in flight,
    and ``unload_adapter`` waits for the views that pin the adapter."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._chat = 0
        self._last_chat = time.monotonic() - QUIET_S
        self._pins: Counter[str] = Counter()
        self._deferred: set[str] = set()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        with self._lock:
            self._chat += 1
        try:
            async with aclosing(self.engine.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            with self._lock:
                self._chat -= 1
                self._last_chat = time.monotonic()

    def quiet(self) -> bool:
        """No chat request in flight, nor in the last ``QUIET_S``."""
        with self._lock:
            return self._chat == 0 and time.monotonic() - self._last_chat >= QUIET_S

    def background(self, slots: int) -> BackgroundEngine:
        return BackgroundEngine(self, slots)

    def pin(self, name: str) -> None:
        with self._lock:
            self._pins[name] += 1

    def unpin(self, names: set[str]) -> None:
        """Drop a view's pins; unload what chat unloaded meanwhile and nothing pins now."""
        with self._lock:
            self._pins -= Counter(names)
            due = {name for name in self._deferred if not self._pins[name]}
            self._deferred -= due
        for name in sorted(due):
            self.engine.unload_adapter(name)

    def load_adapter(self, name: str, path: str) -> None:
        with self._lock:
            self._deferred.discard(name)
        self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if self._pins[name]:
                self._deferred.add(name)
                return
        self.engine.unload_adapter(name)

    def loaded_adapters(self) -> list[str]:
        return self.engine.loaded_adapters()

    def prepare(self, constraint: OutputConstraint) -> None:
        self.engine.prepare(constraint)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return self.engine.chat_prompt(messages)

    def close(self) -> None:
        self.engine.close()


class BackgroundEngine:
    """The shared engine as background work sees it (the module says how it yields to chat and
    pins its adapters). It never unloads an adapter: chat may be serving it."""

    def __init__(self, shared: SharedEngine, slots: int) -> None:
        if slots < 1:
            raise ValueError("a background view needs at least one slot")
        self.shared, self.slots = shared, slots
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self._pinned: set[str] = set()

    def _pin(self, name: str) -> None:
        with self._lock:
            if self._closed:
                raise EngineWithdrawn("the background view of the engine was closed")
            if name in self._pinned:
                return
            self._pinned.add(name)
        self.shared.pin(name)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.adapter is not None:
            self._pin(request.adapter)
        await self._admitted()
        try:
            async with aclosing(self.shared.engine.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except EngineUnavailable as exc:
            if not self._closed:
                raise
            # The server shut the engine down after closing this view: the work was withdrawn.
            raise EngineWithdrawn(f"a closed background view's request failed: {exc}") from exc
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _admitted(self) -> None:
        """Wait for a quiet engine and a free slot, then take the slot."""
        while True:
            if self._closed:
                raise EngineWithdrawn("the background view of the engine was closed")
            if self.shared.quiet():
                with self._lock:
                    if self._in_flight < self.slots:
                        self._in_flight += 1
                        return
            await asyncio.sleep(POLL_S)

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def load_adapter(self, name: str, path: str) -> None:
        """Pin ``name`` and load it if the engine lacks it (an unload chat deferred stays due)."""
        self._pin(name)
        self.shared.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        raise NotImplementedError("background work never unloads an adapter of the shared engine")

    def loaded_adapters(self) -> list[str]:
        return self.shared.engine.loaded_adapters()

    def prepare(self, constraint: OutputConstraint) -> None:
        self.shared.engine.prepare(constraint)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return self.shared.engine.chat_prompt(messages)

    def close(self) -> None:
        """Refuse new requests and drop the view's pins; the requests in flight finish (the
        engine stays the server's)."""
        with self._lock:
            self._closed, pinned = True, self._pinned
            self._pinned = set()
        self.shared.unpin(pinned)
