"""The event log's mapper, at the persistence edge: a domain event (``NewEvent``) into its
stored form at its place in its key's chain, and a stored envelope back into a typed payload.

Domain events know nothing of storage. The mapper serialises a payload once; when the log has
a ``Cipher``, it seals the fields that hold a tenant's words with the tenant's data key
(``core.events.privacy``); it hashes the stored form into the chain and digests the content
(what makes a repeated append of one event id idempotent, or a conflict). Reading, it opens,
upcasts and validates; every event of a tenant whose key is destroyed reads as ``Forgotten``.
Every log (PostgreSQL, Kafka, in memory) and the faust agents hold one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

from core.canonical import canonical_json, sha256_hex
from core.errors import EventIdConflict, InvalidEvent, MacaronError, SequenceConflict
from core.events import Envelope, EventPayload, NewEvent, chain_hash, content_digest
from core.events.catalogue import decode_payload
from core.events.privacy import PRIVATE, Cipher, Forgotten
from core.log import DeadLetter, LogPosition, RecordedEvent, parse_envelope


@dataclass(frozen=True)
class Sealed:
    """An event fixed at its place in its key's chain, with its payload serialised once."""

    envelope: Envelope
    payload: EventPayload
    payload_json: str
    content_digest: str

    def envelope_json(self) -> bytes:
        """The envelope as JSON bytes, reusing the serialised payload."""
        head = canonical_json({**self.envelope.header(), "hash": self.envelope.hash})
        return head[:-1] + b',"payload":' + self.payload_json.encode() + b"}"


@dataclass(frozen=True)
class Mapper:
    """Seals, digests and opens events for a log; ``cipher`` seals tenants' words (``None``:
    payloads are stored as they are, and a sealed one read back is a dead letter)."""

    cipher: Cipher | None = None

    def seal(self, event: NewEvent, sequence: int, prev_hash: str | None) -> Sealed:
        """``event`` fixed at ``sequence`` after ``prev_hash``, with its hash; its private
        fields stored sealed when this mapper has a cipher."""
        try:
            return self._seal(event, sequence, prev_hash)
        except (UnicodeEncodeError, ValueError) as exc:  # lone surrogates, NaN
            raise InvalidEvent(f"{event.payload.event_type} cannot be stored: {exc}") from exc

    def _seal(self, event: NewEvent, sequence: int, prev_hash: str | None) -> Sealed:
        payload = event.payload.model_dump(mode="json")
        # Every field is already validated (by the event and its payload): built directly.
        unhashed = Envelope(
            event_id=event.event_id,
            type=event.payload.event_type,
            schema_version=event.payload.schema_version,
            occurred_at=event.occurred_at,
            tenant_id=event.tenant_id,
            key=event.key,
            sequence=sequence,
            causation_id=event.causation_id,
            correlation_id=event.correlation_id,
            trace=event.trace,
            prev_hash=prev_hash,
            hash="",
            payload=payload,
        )
        private = event.payload.private_fields
        sealed = None if self.cipher is None else self.cipher.seal(payload, private, unhashed)
        if sealed is None:
            payload_bytes = canonical_json(payload)
        else:
            payload, payload_bytes = sealed.stored, sealed.stored_json
        payload_sha256 = sha256_hex(payload_bytes)
        envelope = replace(
            unhashed, payload=payload, hash=chain_hash(unhashed.header(), payload_sha256)
        )
        digest = content_digest(
            envelope.type,
            envelope.schema_version,
            event.tenant_id,
            event.key,
            payload_sha256 if sealed is None else sealed.digest,
        )
        return Sealed(envelope, event.payload, payload_bytes.decode(), digest)

    def content_digest(self, envelope: Envelope) -> str:
        """A stored event's content digest, as ``Sealed.content_digest`` (keyed for a sealed
        event)."""
        keyed = None if self.cipher is None else self.cipher.digest(envelope)
        payload_sha256 = keyed or sha256_hex(canonical_json(envelope.payload))
        return content_digest(
            envelope.type, envelope.schema_version, envelope.tenant_id, envelope.key, payload_sha256
        )

    def seal_batch(
        self,
        events: Sequence[NewEvent],
        stored_digests: Mapping[UUID, str],
        heads: dict[str, tuple[int, str]],
    ) -> list[Sealed]:
        """Seal, in order, the events of a batch not stored yet, continuing each key's chain.

        ``stored_digests`` maps already stored event ids to their content digests; ``heads``
        maps each key to its last (sequence, hash) and is advanced in place. A repeat of a
        stored id with the same content is skipped (idempotent); with other content it is
        ``EventIdConflict``."""
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
            sealed = self.seal(event, sequence + 1, prev_hash)
            if known is not None:
                if known != sealed.content_digest:
                    raise EventIdConflict(f"event {event.event_id} is stored with other content")
                continue
            heads[event.key] = (sealed.envelope.sequence, sealed.envelope.hash)
            digests[event.event_id] = sealed.content_digest
            fresh.append(sealed)
        return fresh

    def warm_keys(self, events: Sequence[NewEvent]) -> None:
        """Fetch (or make) the writing keys of the batch's tenants, so that sealing under the
        append's lock needs no other connection; a forgotten tenant fails here, before
        anything."""
        if self.cipher is not None:
            for tenant_id in {event.tenant_id for event in events}:
                self.cipher.keys.writing_key(tenant_id)

    def is_forgotten(self, tenant_id: str) -> bool:
        """Whether ``tenant_id``'s data key is destroyed (never, without a cipher)."""
        return self.cipher is not None and self.cipher.keys.is_forgotten(tenant_id)

    def decode(self, position: LogPosition, envelope: Envelope) -> RecordedEvent | DeadLetter:
        """Open, upcast and validate a stored envelope's payload, or say why it is a dead
        letter. Every event of a forgotten tenant reads as a ``Forgotten`` marker."""
        try:
            return RecordedEvent(position, envelope, self._open_and_decode(envelope))
        except MacaronError as exc:
            code, reason = exc.code, exc.message
        except Exception as exc:  # an upcaster meeting a payload it cannot lift, say
            code = InvalidEvent.code
            reason = f"{envelope.type} v{envelope.schema_version}: {exc!r}"
        return DeadLetter(position, code, reason, json.dumps(envelope.to_json(), default=str))

    def _open_and_decode(self, envelope: Envelope) -> EventPayload:
        if self.cipher is None:
            if PRIVATE in envelope.payload:
                raise InvalidEvent(
                    f"{envelope.type}: a sealed payload, and no data keys to open it"
                )
            return decode_payload(envelope)
        if self.cipher.keys.is_forgotten(envelope.tenant_id):
            return Forgotten(original_type=envelope.type)
        opened = self.cipher.open(envelope)
        if opened is None:
            return Forgotten(original_type=envelope.type)
        return decode_payload(replace(envelope, payload=opened))

    def decode_stored(
        self, position: LogPosition, raw: bytes | str | Mapping[str, Any] | None
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
        return self.decode(position, envelope)
