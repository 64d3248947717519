"""Lineage and audit: where a release or an adapter version came from, and whether the stored
record still holds.

``lineage`` walks a release (or an adapter version, ``genui@3``) back to the root: each step's
parent, a release's two halves (its harness version and its adapters), the training run that
made it (recipe, config and seed, the dataset snapshot's log range and content hash), the
contract evaluations, and who promoted it and when. ``audit`` checks every key's hash chain in
the log and every adapter's files against their sha256.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from pydantic import BaseModel, JsonValue

from core.errors import AdapterInvalid, AdapterNotFound, HarnessNotFound, ReleaseNotFound
from core.events import Envelope
from core.events.chain import verify_chain
from core.harness.artifact import harness_number
from core.log import EventLog
from infra.artifacts import ArtifactStore
from infra.postgres.backfills import replayed_by
from infra.postgres.db import DictConnection

_ADAPTER = re.compile(r"([a-z][a-z0-9_-]{0,63})@([0-9]{1,9})")


class LineageStep(BaseModel):
    """One release or adapter version on the way back to the root."""

    kind: str
    id: str
    parent: str | None
    created_at: str
    detail: dict[str, JsonValue]


def lineage(conn: DictConnection, ref: str) -> list[LineageStep]:
    """From ``ref`` (a release id or ``specialist@version``) back to the root, newest first."""
    match = _ADAPTER.fullmatch(ref)
    return _adapter_chain(conn, match[1], int(match[2])) if match else _release_chain(conn, ref)


def releases(conn: DictConnection) -> list[LineageStep]:
    """Every release, newest first, each as its own lineage step (adapters, harness, router,
    the run that made it with its evaluations, its promotions)."""
    rows = conn.execute("SELECT release_id FROM releases ORDER BY created_at DESC").fetchall()
    return [release_step(conn, row["release_id"]) for row in rows]


def release_step(conn: DictConnection, release_id: str) -> LineageStep:
    """One release as a lineage step, without its ancestors."""
    return _release_chain(conn, release_id, depth=1)[0]


def _release_chain(
    conn: DictConnection, release_id: str, depth: int | None = None
) -> list[LineageStep]:
    steps: list[LineageStep] = []
    current: str | None = release_id
    while current is not None and (depth is None or len(steps) < depth):
        row = conn.execute("SELECT * FROM releases WHERE release_id = %s", (current,)).fetchone()
        if row is None:
            raise ReleaseNotFound(f"no release {current}")
        adapters = conn.execute(
            "SELECT ra.specialist, a.version, a.sha256 FROM release_adapters ra "
            "JOIN adapter_versions a USING (adapter_version_id) WHERE ra.release_id = %s "
            "ORDER BY ra.specialist",
            (current,),
        ).fetchall()
        promotions = conn.execute(
            "SELECT kind, from_release_id, reason, created_at FROM promotions "
            "WHERE to_release_id = %s ORDER BY created_at",
            (current,),
        ).fetchall()
        detail: dict[str, Any] = {
            "active": row["active"],
            "base_model": row["base_model"],
            "router_version": row["router_version"],
            "harness_version": row["harness_version"],
            "harness": _harness(conn, row["harness_version"]),
            "hcp_version": row["hcp_version"],
            "promoted_by": row["promoted_by"],
            "adapters": {
                a["specialist"]: f"{a['specialist']}@{a['version']} sha256:{a['sha256'][:12]}"
                for a in adapters
            },
            "promotions": [
                {
                    "kind": p["kind"],
                    "from": p["from_release_id"],
                    "reason": p["reason"],
                    "at": p["created_at"].isoformat(),
                }
                for p in promotions
            ],
        }
        if row["run_id"] is not None:
            detail["run"] = run_detail(conn, row["run_id"])
        steps.append(
            LineageStep(
                kind="release",
                id=current,
                parent=row["parent_release_id"],
                created_at=row["created_at"].isoformat(),
                detail=_json(detail),
            )
        )
        current = row["parent_release_id"]
    return steps


def active_release_at(conn: DictConnection, at: datetime) -> str | None:
    """The release the registry had active at ``at``: the last promotion or rollback done by
    then, else the root release if it existed; ``None`` before any release."""
    row = conn.execute(
        "SELECT to_release_id AS release_id FROM promotions "
        "WHERE kind IN ('promoted', 'rolled_back') AND created_at <= %s "
        "ORDER BY created_at DESC LIMIT 1",
        (at,),
    ).fetchone()
    if row is None:
        row = conn.execute(
            "SELECT release_id FROM releases WHERE parent_release_id IS NULL "
            "AND created_at <= %s ORDER BY created_at LIMIT 1",
            (at,),
        ).fetchone()
    return None if row is None else str(row["release_id"])


def _harness(conn: DictConnection, ref: str) -> dict[str, Any]:
    """The registered harness a release names (``harness-1``, from before harnesses were data,
    is ``harness@0``): its name, address and parent."""
    try:
        version = harness_number(ref)
    except HarnessNotFound:
        return {"name": ref, "registered": False}
    row = conn.execute(
        "SELECT name, sha256, parent_version FROM harness_versions WHERE version = %s", (version,)
    ).fetchone()
    if row is None:
        return {"name": ref, "registered": False}
    parent = row["parent_version"]
    return {
        "name": row["name"],
        "sha256": row["sha256"],
        "parent": None if parent is None else f"harness@{parent}",
    }


def _adapter_chain(conn: DictConnection, specialist: str, version: int) -> list[LineageStep]:
    row = conn.execute(
        "SELECT * FROM adapter_versions WHERE specialist = %s AND version = %s",
        (specialist, version),
    ).fetchone()
    if row is None:
        raise AdapterNotFound(f"no adapter version {specialist}@{version}")
    steps = []
    while row is not None:
        parent = None
        if row["parent_id"] is not None:
            parent = conn.execute(
                "SELECT * FROM adapter_versions WHERE adapter_version_id = %s", (row["parent_id"],)
            ).fetchone()
        run = conn.execute(
            "SELECT run_id FROM training_runs WHERE result_adapter_id = %s",
            (row["adapter_version_id"],),
        ).fetchone()
        detail: dict[str, Any] = {
            "sha256": row["sha256"],
            "rank": row["rank"],
            "base_model": row["base_model"],
            "path": row["path"],
        }
        if run is not None:
            detail["run"] = run_detail(conn, run["run_id"])
        steps.append(
            LineageStep(
                kind="adapter",
                id=f"{row['specialist']}@{row['version']}",
                parent=None if parent is None else f"{parent['specialist']}@{parent['version']}",
                created_at=row["created_at"].isoformat(),
                detail=_json(detail),
            )
        )
        row = parent
    return steps


def run_detail(conn: DictConnection, run_id: Any) -> dict[str, JsonValue]:
    """A training run: recipe, config, metrics, its snapshot (with the backfills that replayed
    history into it) and its evaluations."""
    run = conn.execute(
        "SELECT r.*, s.start_positions, s.end_positions, s.filter_version, s.content_hash, "
        "s.record_count, s.backfills, s.left_out_tenants FROM training_runs r "
        "JOIN dataset_snapshots s USING (snapshot_id) "
        "WHERE r.run_id = %s",
        (run_id,),
    ).fetchone()
    assert run is not None  # the foreign key holds
    evaluations = conn.execute(
        "SELECT contract_version, passed, scores->'candidate' AS candidate, scores->'parent' "
        "AS parent, scores->'formats' AS formats, scores->'reasons' AS reasons, created_at "
        "FROM evaluations WHERE run_id = %s ORDER BY created_at",
        (run_id,),
    ).fetchall()
    return _json(
        {
            "run_id": str(run["run_id"]),
            "status": run["status"],
            "recipe": run["recipe"],
            "proposed_harness": None
            if run["result_harness_version"] is None
            else f"harness@{run['result_harness_version']}",
            "config": run["config"],
            "metrics": run["metrics"],
            "snapshot": {
                "id": str(run["snapshot_id"]),
                "start": run["start_positions"],
                "end": run["end_positions"],
                "filter_version": run["filter_version"],
                "content_hash": run["content_hash"],
                "records": run["record_count"],
                "forgotten_tenants_left_out": len(run["left_out_tenants"]),
                "replayed": replayed_by(conn, run["backfills"]),
            },
            "evaluations": [
                {
                    "contract": e["contract_version"],
                    "passed": e["passed"],
                    "candidate": e["candidate"],
                    "parent": e["parent"],
                    "well_formed": e["formats"],
                    "reasons": e["reasons"],
                }
                for e in evaluations
            ],
        }
    )


def _json(value: dict[str, Any]) -> dict[str, JsonValue]:
    result: dict[str, JsonValue] = json.loads(json.dumps(value, default=str))
    return result


def to_dot(steps: list[LineageStep]) -> str:
    """Graphviz: each step a node, an edge to its parent."""
    lines = ["digraph lineage {", "  rankdir=BT;"]
    for step in steps:
        label = step.id
        run = step.detail.get("run")
        if isinstance(run, dict):
            snapshot = run.get("snapshot")
            records = snapshot.get("records") if isinstance(snapshot, dict) else "?"
            label += f"\\nrun {str(run.get('run_id'))[:8]} ({records} records)"
        lines.append(f'  "{step.id}" [label="{label}"];')
        if step.parent is not None:
            lines.append(f'  "{step.id}" -> "{step.parent}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


class AuditReport(BaseModel):
    keys: int
    events: int
    chain_violations: list[str]
    adapters: int
    adapter_failures: list[str]
    erased: int = 0
    """Adapters whose weights were erased on purpose (``adapter_erasures``): not checked."""

    @property
    def ok(self) -> bool:
        return not self.chain_violations and not self.adapter_failures


def audit(conn: DictConnection, log: EventLog, store: ArtifactStore) -> AuditReport:
    """Check every key's hash chain and every registered adapter's files (but those of the
    adapters erased because they learned from a forgotten tenant)."""
    keys: set[str] = set()
    events = 0

    def counted() -> Iterator[Envelope]:
        nonlocal events
        for envelope in log.envelopes():
            events += 1
            keys.add(envelope.key)
            yield envelope

    violations = verify_chain(counted())
    failures = []
    rows = conn.execute(
        "SELECT specialist, version, sha256, path, e.adapter_version_id IS NOT NULL AS erased "
        "FROM adapter_versions LEFT JOIN adapter_erasures e USING (adapter_version_id) "
        "ORDER BY specialist, version"
    ).fetchall()
    for row in rows:
        if row["erased"]:
            continue
        try:
            store.verified_path(row["sha256"], row["path"])
        except (AdapterInvalid, AdapterNotFound) as exc:
            failures.append(f"{row['specialist']}@{row['version']}: {exc.message}")
    return AuditReport(
        keys=len(keys),
        events=events,
        chain_violations=[f"{v.key} #{v.sequence}: {v.kind}" for v in violations],
        adapters=len(rows),
        adapter_failures=failures,
        erased=sum(bool(r["erased"]) for r in rows),
    )
