"""Experience: the names, the record types and the hash chain that the experience builder, the
training trigger and the training run share, so a snapshot replays to the hash it was defined
with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar
from uuid import UUID

from pydantic import BaseModel, ConfigDict, JsonValue

from core.canonical import canonical_json, sha256_hex
from core.errors import UnknownFilterVersion
from core.events import ChatMessage, Envelope, ExperienceRecorded, ExperienceSource, NewEvent
from core.events.privacy import Forgotten
from core.log import EventLog, RecordedEvent
from core.registry import DatasetSnapshot

FILTER_VERSIONS = ("experience-1", "experience-2")
"""Every version of the filter rules (``streams.experience_rules``), oldest first: the live builder
derives under one of them (``MACARON_EXPERIENCE_FILTER``), a backfill under any."""
FILTER_VERSION = FILTER_VERSIONS[-1]
EMPTY_CHAIN = "0" * 64

RecordKind = Literal["sft", "preference", "trajectory", "group"]


class ExperienceRecord(BaseModel):
    """The body of an ``ExperienceRecorded`` event (its ``record``): what the streams write and
    the training run reads. Fields are declared in the order they are stored; every record ends
    with the adapter version that answered and the release it served in."""

    model_config = ConfigDict(frozen=True)
    kind: ClassVar[RecordKind]
    messages: list[ChatMessage]
    """The context the model answered in (without any hint a rollout sample saw)."""

    def stored(self) -> dict[str, JsonValue]:
        """The record as the event holds it: only the optional fields that were given."""
        return self.model_dump(mode="json", exclude_unset=True)


class SFTRecord(ExperienceRecord):
    """An answer to imitate: approved, edited, or a rollout sample its verifier passed."""

    kind: ClassVar[RecordKind] = "sft"
    target: str
    rollout_id: str | None = None
    adapter_version: str | None
    release_id: str | None


class PreferenceRecord(ExperienceRecord):
    """Two answers in one context, the ``chosen`` one better."""

    kind: ClassVar[RecordKind] = "preference"
    chosen: str
    rejected: str
    chosen_rollout_id: str | None = None
    rejected_rollout_id: str | None = None
    adapter_version: str | None
    release_id: str | None


class TrajectoryRecord(ExperienceRecord):
    """A turn as it ran (its actions and answer) with a live reward in [0, 1]."""

    kind: ClassVar[RecordKind] = "trajectory"
    actions: list[dict[str, JsonValue]]
    answer: str | None
    reward: float
    adapter_version: str | None
    release_id: str | None


class GroupSample(BaseModel):
    model_config = ConfigDict(frozen=True)

    answer: str
    reward: float
    """A verified sample's (one whose verifier failed is in no record)."""
    rollout_id: str


class GroupRecord(ExperienceRecord):
    """A rollout group's verified answers with their rewards, for policy gradient."""

    kind: ClassVar[RecordKind] = "group"
    samples: list[GroupSample]
    adapter_version: str | None
    release_id: str | None


Record = TypeVar("Record", bound=ExperienceRecord)


def records_of(kind: type[Record], payloads: Iterable[ExperienceRecorded]) -> list[Record]:
    """The bodies of the ``payloads`` of ``kind``'s kind, typed."""
    return [kind.model_validate(p.record) for p in payloads if p.kind == kind.kind]


def known_filter(version: str) -> str:
    """``version`` if the rules of that filter version exist."""
    if version not in FILTER_VERSIONS:
        raise UnknownFilterVersion(
            f"no experience filter {version!r}; one of {', '.join(FILTER_VERSIONS)}"
        )
    return version


def experience_key(specialist: str) -> str:
    """The log key of a specialist's experience records (one key, so one partition, in order)."""
    return f"experience.{specialist}"


def experience_event(
    record: ExperienceRecorded, tenant_id: str, cause: Envelope, correlation_id: UUID
) -> NewEvent:
    """A record as the event the experience builder appends: on its specialist's key, its id
    the record's, caused by (and dated as) the event it was derived from."""
    return NewEvent(
        payload=record,
        tenant_id=tenant_id,
        key=experience_key(record.specialist),
        event_id=record.experience_id,
        causation_id=cause.event_id,
        correlation_id=correlation_id,
        occurred_at=cause.occurred_at,
    )


@dataclass(frozen=True)
class SnapshotEvents:
    """The records of a snapshot's log range, the specialist's records before it, and how
    many records in the range belong to forgotten tenants (unreadable: never trained on)."""

    records: list[RecordedEvent]
    older: list[RecordedEvent]
    forgotten: int = 0


def snapshot_events(log: EventLog, snapshot: DatasetSnapshot) -> SnapshotEvents:
    """Read a snapshot back from its specialist's experience key:
    the records its filter version derived in its range (live rewards only where it hashed
    them) and those before it. A forgotten tenant's records are unreadable: those of the
    tenants the snapshot leaves out are skipped, the others counted."""
    partition, start, end = snapshot.partition, snapshot.start_offset, snapshot.end_offset
    left_out = set(snapshot.left_out_tenants)
    records, older, forgotten = [], [], 0
    for event in log.read(key=experience_key(snapshot.specialist), types=["ExperienceRecorded"]):
        if event.envelope.tenant_id in left_out:
            continue  # unreadable, or soon: a process's key cache may still open it
        payload: Any = event.payload
        offset = event.position.offset
        in_range = event.position.partition == partition and start <= offset < end
        if isinstance(payload, Forgotten):  # its filter version is unreadable too
            forgotten += in_range
            continue
        if payload.filter_version != snapshot.filter_version:
            continue
        if payload.kind == "trajectory" and not snapshot.rewards_hashed:
            continue  # a range begun before live rewards were hashed
        if in_range:
            records.append(event)
        elif offset < start:
            older.append(event)
    return SnapshotEvents(records, older, forgotten)


def source_of(record: ExperienceRecorded) -> ExperienceSource | None:
    """Where a record's answers came from: its ``source``, or for a record from before sources
    were recorded what its origin tells (a rollout group's, a live reward's); ``None`` for an
    older SFT or preference record from a turn, which a thumbs-up and an edit both gave."""
    if record.source is not None:
        return record.source
    if record.rollout_group_id is not None:
        return "rollout"
    return "feedback" if record.kind == "trajectory" else None


def chain_record(running_hash: str, record: ExperienceRecorded) -> str:
    """The snapshot hash after one more record. A record hashes as it did under the schema it
    was written with (v1 had no ``rollout_group_id``, v2 no ``source``), so older snapshots
    still replay to their hash."""
    data = record.model_dump(mode="json")
    for added in ("rollout_group_id", "source"):
        if data[added] is None:
            del data[added]
    record_hash = sha256_hex(canonical_json(data))
    return sha256_hex(f"{running_hash}{record_hash}".encode())


def first_step(actions: Sequence[Mapping[str, Any]], answer: str | None) -> str:
    """What the model answered to a turn's context first: the tool call it made, when it made
    one (a record's context is the turn's start, so that is the step to teach), else its
    answer."""
    if actions:
        return json.dumps({"tool": actions[0]["name"], "args": actions[0]["args"]})
    return str(answer)
