"""The per-key turn rate limit: a sliding minute per API key."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from uuid import UUID

from core.errors import RateLimited


class TurnRateLimiter:
    def __init__(
        self, per_minute: Callable[[], int], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._per_minute = per_minute  # read at each turn: operators may change the limits
        self._clock = clock
        self._recent: dict[UUID, deque[float]] = {}

    def check(self, key_id: UUID) -> None:
        """Count a turn for ``key_id``, or raise ``RateLimited`` if it had its minute's share."""
        self.room(key_id)
        self._recent[key_id].append(self._clock())

    def room(self, key_id: UUID) -> None:
        """Raise ``RateLimited`` if ``key_id`` had its minute's share, counting nothing (what
        asks for a new turn checks first, so a refused one records nothing)."""
        now, limit = self._clock(), self._per_minute()
        window = self._recent.setdefault(key_id, deque())
        while window and now - window[0] > 60:
            window.popleft()
        if len(window) >= limit:
            wait = 60 - (now - window[0])
            raise RateLimited(f"at most {limit} turns a minute per key; retry in {wait:.0f} s")
