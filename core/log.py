"""The ``EventLog`` port and the records it yields.

Two adapters implement it (PostgreSQL, the embedded default; Kafka, for scale-out), beside one
in memory, and one contract test suite runs against each. Each holds a ``core.mapper.Mapper``,
which turns events into their stored form and back. Positions are per partition: the
PostgreSQL log has one partition (0) whose offsets are its global positions.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from core.errors import InvalidEvent
from core.events import Envelope, EventPayload, NewEvent

Positions = dict[int, int]
"""Partition -> next offset to read (exclusive of everything before it)."""


@dataclass(frozen=True, order=True)
class LogPosition:
    partition: int
    offset: int


@dataclass(frozen=True)
class RecordedEvent:
    """A stored event: where it is, its envelope as stored, and its payload upcast and typed."""

    position: LogPosition
    envelope: Envelope
    payload: EventPayload


@dataclass(frozen=True)
class DeadLetter:
    """An event the reader could not decode; it is set aside with the reason, never dropped."""

    position: LogPosition
    code: str
    reason: str
    raw: str


def parse_envelope(raw: bytes | str | Mapping[str, Any]) -> Envelope:
    """Parse stored bytes or JSON into an envelope; anything malformed is ``InvalidEvent``."""
    try:
        data = json.loads(raw) if isinstance(raw, bytes | str) else dict(raw)
        return Envelope.validate(data)
    except (ValueError, ValidationError, TypeError) as exc:
        raise InvalidEvent(f"malformed envelope: {exc}") from exc
    except RecursionError as exc:
        raise InvalidEvent("malformed envelope: nested too deeply") from exc


class EventLog(Protocol):
    """Append-only, per-key ordered, hash-chained event log."""

    def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        """Append in order, atomically for the batch where the back end allows.

        An event whose id is already stored with the same content is not stored again: the stored
        record is returned. Raises ``SequenceConflict`` if an event names a sequence its key is
        not at, ``EventIdConflict`` if an id is stored with other content.
        """
        ...

    def read(
        self,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        key: str | None = None,
        types: Collection[str] | None = None,
    ) -> Iterator[RecordedEvent]:
        """Stored events from ``start`` (default: the beginning) up to ``end`` (default: the end
        when called), in per-partition order. Undecodable events go to the dead-letter stream
        and the read goes on."""
        ...

    def envelopes(self, *, key: str | None = None) -> Iterator[Envelope]:
        """Stored envelopes, undecoded, in per-key order: for chain verification."""
        ...

    def tail(
        self, *, start: Mapping[int, int] | None = None, idle_timeout: float = 1.0
    ) -> Generator[RecordedEvent | None, None, None]:
        """Follow the log: yields events as they are appended, ``None`` after each
        ``idle_timeout`` seconds without one (so the caller can stop)."""
        ...

    def end_positions(self) -> Positions:
        """The next offset per partition at this moment."""
        ...

    def dead_letters(self) -> list[DeadLetter]: ...

    def close(self) -> None: ...
