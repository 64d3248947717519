"""Identifier generation: UUIDv7 (RFC 9562), time-ordered, used as event ids.

Python 3.11's ``uuid`` module has no ``uuid7``; this is the RFC's layout with the optional
monotonic counter (method 1) so ids made in one process within one millisecond still sort.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def uuid7() -> uuid.UUID:
    """A new UUIDv7: 48-bit Unix milliseconds, 12-bit counter, 62 random bits."""
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(2), "big") & 0x3FF  # leave headroom to count up
        else:
            _counter += 1
            if _counter > 0xFFF:  # counter exhausted: borrow the next millisecond
                _last_ms += 1
                _counter = 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= counter << 64
    value |= 0b10 << 62
    value |= rand
    return uuid.UUID(int=value)


def uuid7_time_ms(value: uuid.UUID) -> int:
    """The Unix millisecond timestamp stored in a UUIDv7."""
    return value.int >> 80


DERIVED = uuid.UUID("6f1d7c52-3b0e-4c2e-9a51-0d6f3c2b8e11")
"""Namespace of derived event ids (uuid5)."""


def derived_id(*parts: object) -> uuid.UUID:
    """The same inputs give the same id, so a re-append after a redelivery is a no-op."""
    return uuid.uuid5(DERIVED, "\x1f".join(str(p) for p in parts))
