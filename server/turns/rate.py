"""The per-key turn rate limit: a moving minute per API key, counted by ``limits`` in memory
(one server) or in Redis (``MACARON_REDIS_URL``: every replica counts in one place, so two
servers do not double a key's limit). The checks block (a Redis round trip): the chat service
runs them off the event loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar
from uuid import UUID

from limits import RateLimitItemPerSecond
from limits.errors import StorageError
from limits.storage import storage_from_string
from limits.strategies import MovingWindowRateLimiter

from core.errors import RateLimited, RateLimitUnavailable

MEMORY = "memory://"
T = TypeVar("T")


class TurnRateLimiter:
    def __init__(
        self, per_minute: Callable[[], int], storage: str = MEMORY, window_s: int = 60
    ) -> None:
        self._per_minute = per_minute  # read at each turn: operators may change the limits
        self._window_s = window_s
        options: dict[str, float | str | bool] = {}
        if storage != MEMORY:  # a Redis that hangs fails the check in seconds, not never
            options = {
                "wrap_exceptions": True,
                "socket_timeout": 2.0,
                "socket_connect_timeout": 2.0,
            }
        self._limiter = MovingWindowRateLimiter(storage_from_string(storage, **options))

    def check(self, key_id: UUID) -> None:
        """Count a turn for ``key_id``, or raise ``RateLimited`` if it had its minute's share."""
        item = self._item()
        if not _reachable(lambda: self._limiter.hit(item, str(key_id))):
            self._refuse(item, key_id)

    def room(self, key_id: UUID) -> None:
        """Raise ``RateLimited`` if ``key_id`` had its minute's share, counting nothing (what
        asks for a new turn checks first, so a refused one records nothing)."""
        item = self._item()
        if not _reachable(lambda: self._limiter.test(item, str(key_id))):
            self._refuse(item, key_id)

    def _item(self) -> RateLimitItemPerSecond:
        return RateLimitItemPerSecond(self._per_minute(), self._window_s)

    def _refuse(self, item: RateLimitItemPerSecond, key_id: UUID) -> None:
        stats = _reachable(lambda: self._limiter.get_window_stats(item, str(key_id)))
        wait = max(0.0, stats.reset_time - time.time())
        window = "a minute" if self._window_s == 60 else f"in {self._window_s} s"
        raise RateLimited(f"at most {item.amount} turns {window} per key; retry in {wait:.0f} s")


def _reachable(ask: Callable[[], T]) -> T:
    """What ``ask`` answers; ``RateLimitUnavailable`` (retryable) when Redis is unreachable:
    a turn is refused rather than let through uncounted."""
    try:
        return ask()
    except StorageError as exc:
        raise RateLimitUnavailable(f"the rate limit's storage is unreachable: {exc}") from exc
