"""The envelope of every event (identity, ordering, provenance, hash chain) and the base of
every payload. Storing an event (its place in its key's chain, its tenant's words sealed) is the
log's mapper's work (``core.mapper``): events know nothing of storage.

An event is an immutable envelope around a typed payload. The envelope stores the payload as
plain JSON at the schema version it was written with; ``core.events.catalogue.decode_payload``
upcasts it to the version this code knows and validates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    field_validator,
)

from core.canonical import canonical_json, sha256_hex
from core.ids import uuid7

HASH_PATTERN = r"^[0-9a-f]{64}$"
_TYPE = r"^[A-Za-z][A-Za-z0-9_.]{0,99}$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$"


def utc_now() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must carry a time zone")
    return value.astimezone(UTC)


Name = Annotated[str, Field(pattern=_NAME)]
Hash = Annotated[str, Field(pattern=HASH_PATTERN)]
UtcTime = Annotated[datetime, AfterValidator(_utc)]


@dataclass(frozen=True, slots=True)
class Envelope:
    """One stored event.

    ``hash`` = sha256(canonical JSON of every other field, with the payload replaced by
    ``payload_sha256``, its own sha256 over canonical JSON). Hashing the payload separately lets
    a writer serialise it once for both the hash and storage.

    A plain dataclass: the log builds trusted envelopes directly (cheap on replay); anything
    from outside goes through ``Envelope.validate``.
    """

    __pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)

    event_id: UUID
    type: Annotated[str, Field(pattern=_TYPE)]
    schema_version: Annotated[int, Field(ge=1)]
    occurred_at: UtcTime
    tenant_id: Name
    key: Name
    sequence: Annotated[int, Field(ge=1)]
    causation_id: UUID | None
    correlation_id: UUID | None
    trace: dict[str, str]
    prev_hash: Hash | None
    hash: Hash
    payload: dict[str, JsonValue]

    @staticmethod
    def validate(data: Any) -> Envelope:
        """Validate untrusted JSON values into an envelope (raises ``ValidationError``)."""
        return _ENVELOPE.validate_python(data)

    def header(self) -> dict[str, Any]:
        """Every field but ``hash`` and ``payload``, as JSON values."""
        return {
            "event_id": str(self.event_id),
            "type": self.type,
            "schema_version": self.schema_version,
            "occurred_at": format_time(self.occurred_at),
            "tenant_id": self.tenant_id,
            "key": self.key,
            "sequence": self.sequence,
            "causation_id": _str_or_none(self.causation_id),
            "correlation_id": _str_or_none(self.correlation_id),
            "trace": self.trace,
            "prev_hash": self.prev_hash,
        }

    def computed_hash(self) -> str:
        return chain_hash(self.header(), sha256_hex(canonical_json(self.payload)))

    def to_json(self) -> dict[str, Any]:
        """The whole envelope as JSON values."""
        return {**self.header(), "hash": self.hash, "payload": self.payload}


_ENVELOPE: TypeAdapter[Envelope] = TypeAdapter(Envelope)


def _str_or_none(value: UUID | None) -> str | None:
    return None if value is None else str(value)


def format_time(value: datetime) -> str:
    return _utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def chain_hash(header: dict[str, Any], payload_sha256: str) -> str:
    return sha256_hex(canonical_json({**header, "payload_sha256": payload_sha256}))


def content_digest(
    type: str, schema_version: int, tenant_id: str, key: str, payload_sha256: str
) -> str:
    """What makes two appends of one event id "the same event" (idempotent) or a conflict.

    The parts are joined with a unit separator, which no type, tenant or key may contain."""
    parts = (type, str(schema_version), tenant_id, key, payload_sha256)
    return sha256_hex("\x1f".join(parts).encode())


class EventPayload(BaseModel):
    """Base of every payload; each subclass names its type and current schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1
    private_fields: ClassVar[tuple[str, ...]] = ()
    """The fields that hold a tenant's words: sealed with its data key (``privacy``)."""


class NewEvent(BaseModel):
    """An event a writer wants appended. The log assigns sequence (unless given) and hashes.

    ``sequence``, when given, is optimistic concurrency: the event must land exactly there,
    or the append fails with ``SequenceConflict``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    payload: EventPayload
    tenant_id: str = Field(pattern=_NAME)
    key: str = Field(pattern=_NAME)
    event_id: UUID = Field(default_factory=uuid7)
    occurred_at: datetime = Field(default_factory=utc_now)
    sequence: int | None = Field(default=None, ge=1)
    causation_id: UUID | None = None
    correlation_id: UUID | None = None
    trace: dict[str, str] = Field(default_factory=dict)

    _normalise_time = field_validator("occurred_at")(_utc)
