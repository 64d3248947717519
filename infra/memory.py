"""The in-memory event log: plain Python objects, for unit tests of what runs over the log.

It passes the same contract suite as the PostgreSQL and Kafka logs (one partition, positions
from 1, as in PostgreSQL), so application logic can be tested in milliseconds without a server.
One lock serialises appends and reads; a condition on it wakes tailers. Nothing survives the
process.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

from core.errors import EventIdConflict, InvalidEvent, TenantForgotten
from core.events import Envelope, EventPayload, NewEvent
from core.events.privacy import Cipher, DataKey
from core.log import DeadLetter, LogPosition, Positions, RecordedEvent, parse_envelope
from core.mapper import Mapper

PARTITION = 0

_Stored = tuple[Envelope, EventPayload | None]
"""An envelope and, when this log appended it, its typed payload (else decoded on read)."""


class InMemoryEventLog:
    """``EventLog`` over a list in this process."""

    def __init__(self, cipher: Cipher | None = None) -> None:
        self._mapper = Mapper(cipher)
        self._stored: list[_Stored] = []  # the event at offset n is self._stored[n - 1]
        self._offsets: dict[UUID, int] = {}  # event id -> offset of its first copy
        self._heads: dict[str, tuple[int, str]] = {}  # key -> (sequence, hash) of its last event
        self._letters: dict[int, DeadLetter] = {}  # by offset: each undecodable event once
        self._changed = threading.Condition()

    def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        with self._changed:
            stored = {
                e.event_id: self._recorded(self._offsets[e.event_id])
                for e in events
                if e.event_id in self._offsets
            }
            digests = {i: self._mapper.content_digest(r.envelope) for i, r in stored.items()}
            heads = {e.key: self._heads[e.key] for e in events if e.key in self._heads}
            fresh = self._mapper.seal_batch(events, digests, heads)  # raises before storing
            for sealed in fresh:
                offset = self._store(sealed.envelope, sealed.payload)
                stored[sealed.envelope.event_id] = RecordedEvent(
                    LogPosition(PARTITION, offset), sealed.envelope, sealed.payload
                )
            if fresh:
                self._changed.notify_all()
        return [stored[event.event_id] for event in events]

    def store_raw(self, envelope: Mapping[str, Any]) -> LogPosition:
        """Store an envelope as it is, unchecked, as a writer of another code version (or an
        attacker with access to this process) could; it is decoded, or dead-lettered, on read."""
        with self._changed:
            offset = self._store(parse_envelope(envelope), None)
            self._changed.notify_all()
        return LogPosition(PARTITION, offset)

    def _store(self, envelope: Envelope, payload: EventPayload | None) -> int:
        self._stored.append((envelope, payload))
        offset = len(self._stored)
        self._offsets.setdefault(envelope.event_id, offset)
        if self._heads.get(envelope.key, (0, ""))[0] < envelope.sequence:
            self._heads[envelope.key] = (envelope.sequence, envelope.hash)
        return offset

    def _recorded(self, offset: int) -> RecordedEvent:
        """The stored event at ``offset``, which a repeated append returns."""
        record = self._decoded(offset)
        if isinstance(record, DeadLetter):
            raise EventIdConflict(
                f"event at offset {offset} is stored but cannot be decoded: {record.reason}"
            )
        return record

    def _decoded(self, offset: int) -> RecordedEvent | DeadLetter:
        envelope, payload = self._stored[offset - 1]
        position = LogPosition(PARTITION, offset)
        if payload is not None and not self._mapper.is_forgotten(envelope.tenant_id):
            return RecordedEvent(position, envelope, payload)
        return self._mapper.decode(position, envelope)

    def read(
        self,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        key: str | None = None,
        types: Collection[str] | None = None,
    ) -> Iterator[RecordedEvent]:
        first = max((start or {}).get(PARTITION, 1), 1)
        with self._changed:
            stop = min((end or {}).get(PARTITION, len(self._stored) + 1), len(self._stored) + 1)
            stored = self._stored[first - 1 : stop - 1]
        for offset, (envelope, _) in enumerate(stored, start=first):
            if (key is None or envelope.key == key) and (types is None or envelope.type in types):
                record = self._read_one(offset)
                if record is not None:
                    yield record

    def _read_one(self, offset: int) -> RecordedEvent | None:
        """The event at ``offset``, or ``None`` once it is set aside as a dead letter."""
        record = self._decoded(offset)
        if isinstance(record, DeadLetter):
            with self._changed:
                self._letters.setdefault(offset, record)
            return None
        return record

    def envelopes(self, *, key: str | None = None) -> Iterator[Envelope]:
        with self._changed:
            stored = list(self._stored)
        for envelope, _ in stored:
            if key is None or envelope.key == key:
                yield envelope

    def tail(
        self, *, start: Mapping[int, int] | None = None, idle_timeout: float = 1.0
    ) -> Generator[RecordedEvent | None, None, None]:
        cursor = max((start or {}).get(PARTITION, 1), 1)
        while True:
            with self._changed:
                if cursor > len(self._stored):
                    self._changed.wait(idle_timeout)
                stop = len(self._stored) + 1
            if cursor == stop:
                yield None
                continue
            for offset in range(cursor, stop):
                record = self._read_one(offset)
                if record is not None:
                    yield record
            cursor = stop

    def end_positions(self) -> Positions:
        with self._changed:
            return {PARTITION: len(self._stored) + 1}

    def dead_letters(self) -> list[DeadLetter]:
        with self._changed:
            return [self._letters[offset] for offset in sorted(self._letters)]

    def close(self) -> None:
        """Nothing to release: the events live as long as this object."""


class InMemoryDataKeys:
    """Tenants' data keys in this process, unwrapped (``DataKeys``): for unit tests."""

    def __init__(self) -> None:
        self._keys: dict[str, DataKey] = {}
        self._forgotten: set[str] = set()

    def writing_key(self, tenant_id: str) -> DataKey:
        if tenant_id in self._forgotten:
            raise TenantForgotten(f"tenant {tenant_id!r} was forgotten: nothing more is stored")
        if tenant_id not in self._keys:
            self._keys[tenant_id] = DataKey.new(uuid.uuid4())
        return self._keys[tenant_id]

    def reading_key(self, tenant_id: str, key_id: UUID) -> DataKey | None:
        if tenant_id in self._forgotten:
            return None
        key = self._keys.get(tenant_id)
        if key is None or key.key_id != key_id:
            raise InvalidEvent(f"no data key {key_id} for tenant {tenant_id!r} here")
        return key

    def is_forgotten(self, tenant_id: str) -> bool:
        return tenant_id in self._forgotten

    def forget(self, tenant_id: str) -> bool:
        self._keys.pop(tenant_id, None)
        newly = tenant_id not in self._forgotten
        self._forgotten.add(tenant_id)
        return newly
