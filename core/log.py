"""The ``EventLog`` port and the records it yields.

Two adapters implement it (PostgreSQL, the embedded default; Kafka, for scale-out) and one
contract test suite runs against both. Positions are per partition: the PostgreSQL log has one
partition (0) whose offsets are its global positions.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol
from uuid import UUID

from pydantic import ValidationError

from core.errors import EventIdConflict, InvalidEvent, MacaronError, SequenceConflict
from core.events import Envelope, EventPayload, NewEvent, Sealed, decode_payload
from core.events.privacy import PRIVATE, Cipher, Forgotten

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


def decode_envelope(
    position: LogPosition, envelope: Envelope, cipher: Cipher | None = None
) -> RecordedEvent | DeadLetter:
    """Open (with ``cipher``), upcast and validate a stored envelope's payload, or say why it is
    a dead letter. Every event of a forgotten tenant reads as a ``Forgotten`` marker."""
    try:
        return RecordedEvent(position, envelope, _open_and_decode(envelope, cipher))
    except MacaronError as exc:
        code, reason = exc.code, exc.message
    except Exception as exc:  # an upcaster meeting a payload it cannot lift, say
        code, reason = InvalidEvent.code, f"{envelope.type} v{envelope.schema_version}: {exc!r}"
    return DeadLetter(position, code, reason, json.dumps(envelope.to_json(), default=str))


def _open_and_decode(envelope: Envelope, cipher: Cipher | None) -> EventPayload:
    if cipher is None:
        if PRIVATE in envelope.payload:
            raise InvalidEvent(f"{envelope.type}: a sealed payload, and no data keys to open it")
        return decode_payload(envelope)
    if cipher.keys.is_forgotten(envelope.tenant_id):
        return Forgotten(original_type=envelope.type)
    opened = cipher.open(envelope)
    if opened is None:
        return Forgotten(original_type=envelope.type)
    return decode_payload(replace(envelope, payload=opened))


def decode_stored(
    position: LogPosition, raw: bytes | str | Mapping[str, Any] | None, cipher: Cipher | None = None
) -> RecordedEvent | DeadLetter:
    """Parse and decode one stored record, or say why it goes to the dead-letter stream."""
    if raw is None:  # a Kafka tombstone: never written by this log
        return DeadLetter(position, InvalidEvent.code, "record has no value", "")
    try:
        envelope = parse_envelope(raw)
    except InvalidEvent as exc:
        if isinstance(raw, bytes):
            text = raw.decode("utf-8", "replace")
        else:
            text = raw if isinstance(raw, str) else json.dumps(dict(raw), default=str)
        return DeadLetter(position, exc.code, exc.message, text)
    return decode_envelope(position, envelope, cipher)


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


def seal_batch(
    events: Sequence[NewEvent],
    stored_digests: Mapping[UUID, str],
    heads: dict[str, tuple[int, str]],
    cipher: Cipher | None = None,
) -> list[Sealed]:
    """Seal, in order, the events of a batch that are not stored yet, continuing each key's chain.

    ``stored_digests`` maps already stored event ids to their content digests; ``heads`` maps each
    key to its last (sequence, hash) and is advanced in place. A repeat of a stored id with the
    same content is skipped (idempotent); with other content it is ``EventIdConflict``.
    """
    digests = dict(stored_digests)
    fresh: list[Sealed] = []
    for event in events:
        known = digests.get(event.event_id)
        sequence, prev_hash = heads.get(event.key, (0, None))
        if known is None and event.sequence is not None and event.sequence != sequence + 1:
            raise SequenceConflict(
                f"key {event.key!r} is at sequence {sequence}; "
                f"event {event.event_id} expected to be {event.sequence}"
            )
        sealed = event.seal(sequence + 1, prev_hash, cipher)
        if known is not None:
            if known != sealed.content_digest:
                raise EventIdConflict(f"event {event.event_id} is stored with other content")
            continue
        heads[event.key] = (sealed.envelope.sequence, sealed.envelope.hash)
        digests[event.event_id] = sealed.content_digest
        fresh.append(sealed)
    return fresh


def warm_keys(cipher: Cipher | None, events: Sequence[NewEvent]) -> None:
    """Fetch (or make) the writing keys of the batch's tenants, so that sealing under the
    append's lock needs no other connection; a forgotten tenant fails here, before anything."""
    if cipher is not None:
        for tenant_id in {event.tenant_id for event in events}:
            cipher.keys.writing_key(tenant_id)
