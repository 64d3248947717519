"""Upcasters: turn a stored payload of an old schema version into the current one, on read.

Stored events are never rewritten. Each upcaster lifts one version (``v`` to ``v + 1``) of one
event type; reading applies them in a chain until the payload reaches the version the code knows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import UnknownSchemaVersion

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]


class UpcasterRegistry:
    def __init__(self) -> None:
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator: register ``fn`` as the upcaster of ``event_type`` from ``from_version``."""

        def decorate(fn: Upcaster) -> Upcaster:
            slot = (event_type, from_version)
            if slot in self._upcasters:
                raise ValueError(f"an upcaster for {event_type} v{from_version} already exists")
            self._upcasters[slot] = fn
            return fn

        return decorate

    def upcast(self, event_type: str, version: int, payload: Payload, target: int) -> Payload:
        """Lift ``payload`` from ``version`` to ``target``; a gap or a newer version is an error."""
        if version > target:
            raise UnknownSchemaVersion(
                f"{event_type} v{version} is newer than this code knows (v{target})"
            )
        while version < target:
            step = self._upcasters.get((event_type, version))
            if step is None:
                raise UnknownSchemaVersion(f"no upcaster for {event_type} from v{version}")
            payload = step(dict(payload))
            version += 1
        return payload
