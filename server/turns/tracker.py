"""Which release (and its harness) serves new turns, and which adapters may be unloaded.

A turn keeps the release and the harness it began with to its end, so an adapter that a newer
release no longer serves stays loaded until the last turn on it ends.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from core.engine import Engine
from core.errors import MacaronError
from core.harness.artifact import HarnessVersion
from core.release import Release
from infra import observe

_log = logging.getLogger(__name__)


class ReleaseTracker:
    def __init__(self, engine: Engine, release: Release, harness: HarnessVersion) -> None:
        self.engine = engine
        self.release = release
        self.harness = harness  # the harness ``release`` names, loaded from the registry
        self.serving_since = time.time()  # wall-clock moment ``release`` began to be served
        self._turns_on: Counter[str] = Counter()  # turns in flight, by the release they began on
        self._busy: dict[str, Release] = {}  # those releases
        self._unused: set[str] = set()  # adapters a past release served: unload once unused

    def serve(self, release: Release, harness: HarnessVersion) -> None:
        """Answer new turns with ``release`` and its ``harness`` (swapped together: nothing
        awaits in between); unload what the old release served once unused."""
        old, self.release, self.harness = self.release, release, harness
        self.serving_since = time.time()
        self._unused |= {ref.name for ref in old.adapters.values()}
        self._unload_unused()
        _log.info("serving release %s", release.release_id)

    @contextmanager
    def turn(self) -> Iterator[tuple[Release, HarnessVersion]]:
        """The release and harness a new turn is answered with, held until the turn ends.
        Nothing awaits between reading them and counting the turn in, so a promotion cannot
        unload its adapters in between."""
        release, harness = self.release, self.harness
        self._turns_on[release.release_id] += 1
        self._busy[release.release_id] = release
        try:
            yield release, harness
        finally:
            self._turns_on[release.release_id] -= 1
            if not self._turns_on[release.release_id]:
                del self._turns_on[release.release_id], self._busy[release.release_id]
                self._unload_unused()

    def _unload_unused(self) -> None:
        serving = [self.release, *self._busy.values()]
        used = {ref.name for r in serving for ref in r.adapters.values()}
        loaded = set(self.engine.loaded_adapters())
        for name in self._unused - used:
            if name in loaded:
                try:
                    self.engine.unload_adapter(name)
                except MacaronError as exc:  # the turn that ended must not fail for this
                    _log.warning("could not unload adapter %s: %s", name, exc.message)
        self._unused &= used
        observe.adapters_loaded.set(len(self.engine.loaded_adapters()))
