"""One answer, audited end to end: ``macaron audit turn`` and ``GET /admin/turns/{id}/audit``.

From a turn id: the turn's events with their hashes and its conversation's chain verified; the
release, adapter, router and harness versions that served it; for the adapter, the training
run that made it, its snapshot's log range and the experience records that taught it, each
with the event it was derived from (the feedback, live reward or rollout verdict); and the
turn's trace id. Records are counted; an operator (the command line, an admin key) also gets
each record's id and source, and its content when asked for, since these are other
conversations' words: a tenant auditing its own turn gets the counts only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, JsonValue

from core.errors import TurnNotFound
from core.events.chain import verify_chain
from core.experience import snapshot_events
from core.log import EventLog
from infra.postgres.db import DictConnection
from infra.postgres.lineage import active_release_at, run_detail
from infra.postgres.runs import snapshot_of

Shown = Literal["counts", "ids", "content"]
"""How much of the training records an audit shows: counts, each one's ids, or content too."""


class AuditedEvent(BaseModel):
    sequence: int
    type: str
    event_id: str
    occurred_at: str
    hash: str
    prev_hash: str | None


class ServedBy(BaseModel):
    """What served the turn, as its events recorded it; ``registry_active_then`` is the release
    the registry had active when the turn was received, for comparison."""

    release_id: str | None
    release_active_now: bool | None
    registry_active_then: str | None
    specialist: str | None
    adapter_version: str | None
    router_version: str | None
    harness_version: str | None
    hcp_version: str | None


class TaughtBy(BaseModel):
    """One experience record of the snapshot, and the event it was derived from."""

    experience_id: str
    kind: str
    source: str
    cause_event_id: str | None
    turn_id: str | None
    rollout_group_id: str | None
    record: dict[str, JsonValue] | None = None


class Training(BaseModel):
    """The run that made the adapter and its snapshot's records (``records`` empty when only
    counts were asked for). Not listed: the specialist's older records that training replays
    beside the snapshot against forgetting."""

    run: dict[str, JsonValue]
    counts: dict[str, int]
    records: list[TaughtBy]


class TurnAudit(BaseModel):
    turn_id: str
    conversation_id: str
    tenant_id: str
    trace_id: str | None
    events: list[AuditedEvent]
    chain_events: int
    chain_violations: list[str]
    served_by: ServedBy
    training: Training | None
    """``None`` when a root adapter (version 0) or none answered: nothing taught it."""

    @property
    def chain_ok(self) -> bool:
        return not self.chain_violations


def audit_turn(
    conn: DictConnection,
    log: EventLog,
    turn_id: UUID,
    *,
    tenant_id: str | None,
    records: Shown,
) -> TurnAudit:
    """Audit ``turn_id``; ``tenant_id`` scopes the lookup (another tenant's turn is not found,
    as if it did not exist); ``None`` audits any tenant's. ``records``: how much of the
    training records to show (their counts, each one's ids, or their content too)."""
    row = conn.execute(
        "SELECT conversation_id, tenant_id FROM turns WHERE turn_id = %s", (turn_id,)
    ).fetchone()
    if row is None or (tenant_id is not None and row["tenant_id"] != tenant_id):
        raise TurnNotFound(
            f"no turn {turn_id} for this tenant in the projections "
            "(are the stream processors running?)"
        )
    key = str(row["conversation_id"])
    envelopes = list(log.envelopes(key=key))
    violations = verify_chain(envelopes)
    mine = [e for e in log.read(key=key) if getattr(e.payload, "turn_id", None) == turn_id]
    payloads: dict[str, Any] = {e.envelope.type: e.payload for e in mine}
    received = [e.envelope for e in mine if e.envelope.type == "TurnReceived"]
    traceparent = received[0].trace.get("traceparent") if received else None
    served = _served_by(conn, payloads)
    if received:
        served.registry_active_then = active_release_at(conn, received[0].occurred_at)
    return TurnAudit(
        turn_id=str(turn_id),
        conversation_id=key,
        tenant_id=row["tenant_id"],
        trace_id=None if traceparent is None else traceparent.split("-")[1],
        events=[
            AuditedEvent(
                sequence=e.envelope.sequence,
                type=e.envelope.type,
                event_id=str(e.envelope.event_id),
                occurred_at=e.envelope.occurred_at.isoformat(),
                hash=e.envelope.hash,
                prev_hash=e.envelope.prev_hash,
            )
            for e in mine
        ],
        chain_events=len(envelopes),
        chain_violations=[f"{v.key} #{v.sequence}: {v.kind}" for v in violations],
        served_by=served,
        training=_training(conn, log, served.adapter_version, records),
    )


def _served_by(conn: DictConnection, payloads: dict[str, Any]) -> ServedBy:
    responded = payloads.get("ModelResponded")
    decided = payloads.get("RouterDecided")
    received = payloads.get("TurnReceived")
    stamp = next((p.harness for p in payloads.values() if getattr(p, "harness", None)), None)
    release_id = responded.release_id if responded else getattr(received, "release_id", None)
    active = None
    if release_id is not None:
        release = conn.execute(
            "SELECT active FROM releases WHERE release_id = %s", (release_id,)
        ).fetchone()
        active = None if release is None else bool(release["active"])
    return ServedBy(
        release_id=release_id,
        release_active_now=active,
        registry_active_then=None,
        specialist=responded.specialist if responded else getattr(decided, "specialist", None),
        adapter_version=responded.adapter_version if responded else None,
        router_version=decided.router_version if decided else None,
        harness_version=None if stamp is None else stamp.harness_version,
        hcp_version=None if stamp is None else stamp.hcp_version,
    )


def _training(
    conn: DictConnection,
    log: EventLog,
    adapter: str | None,
    shown: Shown,
) -> Training | None:
    """The run that made ``adapter`` (``genui@2``) and the records of its snapshot."""
    specialist, _, version = (adapter or "").partition("@")
    if not version.isdigit():
        return None
    run = conn.execute(
        "SELECT r.run_id, s.* FROM training_runs r "
        "JOIN adapter_versions a ON a.adapter_version_id = r.result_adapter_id "
        "JOIN dataset_snapshots s ON s.snapshot_id = r.snapshot_id "
        "WHERE a.specialist = %s AND a.version = %s",
        (specialist, int(version)),
    ).fetchone()
    if run is None:
        return None
    records = []
    for event in snapshot_events(log, snapshot_of(run)).records:
        payload: Any = event.payload
        from_rollouts = payload.rollout_group_id is not None
        records.append(
            TaughtBy(
                experience_id=str(payload.experience_id),
                kind=payload.kind,
                source="rollout" if from_rollouts else "turn",
                cause_event_id=_str(event.envelope.causation_id),
                turn_id=_str(payload.turn_id),
                rollout_group_id=_str(payload.rollout_group_id),
                record=payload.record if shown == "content" else None,
            )
        )
    counts = Counter(f"{r.source} {r.kind}" for r in records)
    return Training(
        run=run_detail(conn, run["run_id"]),
        counts=dict(sorted(counts.items())),
        records=[] if shown == "counts" else records,
    )


def _str(value: UUID | None) -> str | None:
    return None if value is None else str(value)
