"""Training runs, the dataset snapshots they train on, and the contract evaluations of their
candidates (``training_runs``, ``dataset_snapshots``, ``evaluations``).

A run's ``kind`` says what it makes: an ``adapter`` (trained) or a ``harness`` (proposed).
A run is ``queued`` by the trigger, ``running`` under a lease while a worker trains it, then
``succeeded`` (with its adapter or harness) or ``failed`` (with the error). At most one run per
specialist is in flight (a unique index).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from core.registry import (
    ContractScore,
    DatasetSnapshot,
    EvaluationRecord,
    QueuedRun,
    RunKind,
    RunOutput,
    RunResult,
    StoredOutcomes,
    TrainingRun,
)
from infra.postgres.db import DictConnection


def record_snapshot(conn: DictConnection, snapshot: DatasetSnapshot) -> None:
    conn.execute(
        "INSERT INTO dataset_snapshots (snapshot_id, specialist, start_positions, "
        "end_positions, filter_version, content_hash, record_count, rewards_hashed, backfills, "
        "left_out_tenants) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING",
        (
            snapshot.snapshot_id,
            snapshot.specialist,
            Jsonb({str(snapshot.partition): snapshot.start_offset}),
            Jsonb({str(snapshot.partition): snapshot.end_offset}),
            snapshot.filter_version,
            snapshot.content_hash,
            snapshot.record_count,
            snapshot.rewards_hashed,
            list(snapshot.backfills),
            list(snapshot.left_out_tenants),
        ),
    )


def dataset_snapshot(conn: DictConnection, snapshot_id: UUID) -> DatasetSnapshot | None:
    row = conn.execute(
        "SELECT * FROM dataset_snapshots WHERE snapshot_id = %s", (snapshot_id,)
    ).fetchone()
    return None if row is None else snapshot_of(row)


def snapshot_of(row: Mapping[str, Any]) -> DatasetSnapshot:
    """A ``dataset_snapshots`` row as its record (one partition's range)."""
    [(partition, start)] = row["start_positions"].items()
    [(_, end)] = row["end_positions"].items()
    return DatasetSnapshot(
        snapshot_id=row["snapshot_id"],
        specialist=row["specialist"],
        partition=int(partition),
        start_offset=int(start),
        end_offset=int(end),
        filter_version=row["filter_version"],
        content_hash=row["content_hash"],
        record_count=row["record_count"],
        rewards_hashed=row["rewards_hashed"],
        backfills=tuple(row["backfills"] or ()),
        left_out_tenants=tuple(row["left_out_tenants"] or ()),
    )


def queue_run(conn: DictConnection, run: QueuedRun) -> bool:
    """Queue the run; ``False`` when it was not (it exists, or a run of the specialist is in
    flight)."""
    inserted = conn.execute(
        "INSERT INTO training_runs (run_id, specialist, parent_adapter_id, snapshot_id, "
        "kind, recipe, status, unlearning) VALUES (%s, %s, %s, %s, %s, %s, 'queued', %s) "
        "ON CONFLICT DO NOTHING RETURNING run_id",
        (
            run.run_id,
            run.specialist,
            run.parent_adapter_id,
            run.snapshot_id,
            run.kind,
            run.recipe,
            run.unlearning,
        ),
    ).fetchone()
    return inserted is not None


def run_in_flight(conn: DictConnection, specialist: str) -> bool:
    """Whether a run of ``specialist`` is queued or running."""
    row = conn.execute(
        "SELECT 1 FROM training_runs WHERE specialist = %s AND status IN ('queued', 'running')",
        (specialist,),
    ).fetchone()
    return row is not None


def queued_run_ids(conn: DictConnection) -> list[UUID]:
    rows = conn.execute("SELECT run_id FROM training_runs WHERE status = 'queued'").fetchall()
    return [r["run_id"] for r in rows]


def training_run(conn: DictConnection, run_id: UUID) -> TrainingRun | None:
    row = conn.execute("SELECT * FROM training_runs WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else run_of(row)


def run_of(row: Mapping[str, Any]) -> TrainingRun:
    """A ``training_runs`` row as its record."""
    return TrainingRun(
        run_id=row["run_id"],
        specialist=row["specialist"],
        parent_adapter_id=row["parent_adapter_id"],
        snapshot_id=row["snapshot_id"],
        kind=row["kind"],
        recipe=row["recipe"],
        status=row["status"],
        unlearning=row["unlearning"],
        created_at=row["created_at"],
        result_adapter_id=row["result_adapter_id"],
        result_harness_version=row["result_harness_version"],
        metrics=row["metrics"],
        error=row["error"],
    )


def claim_run(conn: DictConnection, run_id: UUID, lease_seconds: int) -> TrainingRun | None:
    """Take the run if it is queued and nobody holds a live lease on it."""
    row = conn.execute(
        "UPDATE training_runs SET status = 'running', lease_until = now() + %s * interval '1 s' "
        "WHERE run_id = %s AND (status = 'queued' OR (status = 'running' AND lease_until < now())) "
        "RETURNING *",
        (lease_seconds, run_id),
    ).fetchone()
    return None if row is None else run_of(row)


def run_result(conn: DictConnection, run_id: UUID) -> RunResult | None:
    """The run's status and, once it succeeded, its adapter's specialist and version, or the
    harness version it proposed (``harness_version``)."""
    row = conn.execute(
        "SELECT r.status, a.specialist, a.version, r.result_harness_version AS harness_version "
        "FROM training_runs r LEFT JOIN "
        "adapter_versions a ON a.adapter_version_id = r.result_adapter_id "
        "WHERE r.run_id = %s",
        (run_id,),
    ).fetchone()
    return None if row is None else RunResult(**row)


def renew_lease(conn: DictConnection, run_id: UUID, lease_seconds: int) -> None:
    conn.execute(
        "UPDATE training_runs SET lease_until = now() + %s * interval '1 s' WHERE run_id = %s",
        (lease_seconds, run_id),
    )


def fail_run(conn: DictConnection, run_id: UUID, error: str) -> None:
    conn.execute(
        "UPDATE training_runs SET status = 'failed', error = %s, "
        "finished_at = now() WHERE run_id = %s",
        (error, run_id),
    )


def finish_run(conn: DictConnection, run_id: UUID, output: RunOutput) -> None:
    """Mark the run succeeded with what it made: a trained adapter or a proposed harness."""
    conn.execute(
        "UPDATE training_runs SET status = 'succeeded', result_adapter_id = %s, "
        "result_harness_version = %s, config = %s, metrics = %s, finished_at = now(), "
        "lease_until = NULL, recipe = COALESCE(%s, recipe) WHERE run_id = %s",
        (
            output.adapter_version_id,
            output.harness_version,
            Jsonb(output.config),
            Jsonb(output.metrics),
            output.recipe,
            run_id,
        ),
    )


def runs_of_kind(conn: DictConnection, specialist: str, kind: RunKind) -> int:
    """How many runs of ``specialist`` were of ``kind``."""
    row = conn.execute(
        "SELECT count(*) AS n FROM training_runs WHERE specialist = %s AND kind = %s",
        (specialist, kind),
    ).fetchone()
    return 0 if row is None else int(row["n"])


def record_evaluation(conn: DictConnection, evaluation: EvaluationRecord) -> None:
    """Record a candidate's evaluation once (a redelivered task records nothing new)."""
    e = evaluation
    conn.execute(
        "INSERT INTO evaluations (evaluation_id, run_id, adapter_version_id, "
        "contract_version, scores, passed) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING",
        (
            e.evaluation_id,
            e.run_id,
            e.adapter_version_id,
            e.contract_version,
            Jsonb(e.scores),
            e.passed,
        ),
    )


def record_release_score(
    conn: DictConnection,
    *,
    evaluation_id: UUID,
    release_id: str,
    contract_version: str,
    scores: dict[str, Any],
) -> None:
    """Record a release scored on its own (no run, so no verdict), once per id."""
    conn.execute(
        "INSERT INTO evaluations (evaluation_id, release_id, contract_version, scores) "
        "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (evaluation_id, release_id, contract_version, Jsonb(scores)),
    )


def evaluated_outcomes(
    conn: DictConnection, release_id: str, contract_version: str
) -> list[StoredOutcomes]:
    """Every per-task record of ``release_id`` under ``contract_version``, as the candidate of
    the run that made it, as the parent of a run, or scored on its own: ``outcomes`` (passed),
    ``well_formed`` per suite, the ``tasks`` they were got on and the ``digest`` stored with
    them (JSON, not validated)."""
    rows = conn.execute(
        "SELECT e.scores -> 'outcomes' -> 'candidate' AS outcomes, "
        "e.scores -> 'well_formed' -> 'candidate' AS well_formed, e.scores -> 'tasks' AS tasks, "
        "e.scores -> 'digests' ->> 'candidate' AS digest FROM releases r "
        "JOIN evaluations e ON e.run_id = r.run_id "
        "WHERE r.release_id = %(release)s AND e.contract_version = %(version)s "
        "UNION ALL SELECT scores -> 'outcomes' -> 'parent', scores -> 'well_formed' -> 'parent', "
        "scores -> 'tasks', scores -> 'digests' ->> 'parent' FROM evaluations "
        "WHERE scores ->> 'parent_release_id' = %(release)s AND contract_version = %(version)s "
        "UNION ALL SELECT scores -> 'outcomes' -> 'release', scores -> 'well_formed' -> 'release', "
        "scores -> 'tasks', scores -> 'digests' ->> 'release' FROM evaluations "
        "WHERE run_id IS NULL AND release_id = %(release)s AND contract_version = %(version)s",
        {"release": release_id, "version": contract_version},
    ).fetchall()
    return [StoredOutcomes(**r) for r in rows]


def contract_scores(conn: DictConnection) -> list[ContractScore]:
    """Each release's contract scores per contract version (share of tasks passed and share
    well-formed, per suite), whichever evaluation measured every task first (as a run's
    candidate or parent, or on its own; a candidate's record that stopped early, with tasks
    not run, only when there is no other), oldest release first."""
    rows = conn.execute(
        "SELECT DISTINCT ON (s.release_id, s.contract_version) s.*, r.created_at AS released "
        "FROM ("
        "  SELECT r.release_id, e.contract_version, e.created_at, e.scores -> 'candidate' AS "
        "  scores, e.scores -> 'formats' -> 'candidate' AS formats, "
        "  e.scores -> 'outcomes' -> 'candidate' AS outcomes FROM releases r "
        "  JOIN evaluations e ON e.run_id = r.run_id "
        "  UNION ALL SELECT scores ->> 'parent_release_id', contract_version, created_at, "
        "  scores -> 'parent', scores -> 'formats' -> 'parent', scores -> 'outcomes' -> 'parent' "
        "  FROM evaluations WHERE scores ? 'parent_release_id' "
        "  UNION ALL SELECT release_id, contract_version, created_at, scores -> 'release', "
        "  scores -> 'formats' -> 'release', scores -> 'outcomes' -> 'release' "
        "  FROM evaluations WHERE run_id IS NULL"
        ") s JOIN releases r ON r.release_id = s.release_id "
        "ORDER BY s.release_id, s.contract_version, "
        "COALESCE(s.outcomes::text LIKE '%null%', false), s.created_at"
    ).fetchall()
    found = [
        ContractScore(
            release_id=row["release_id"],
            contract_version=row["contract_version"],
            released_at=row["released"],
            scores=row["scores"],
            well_formed=row["formats"],
        )
        for row in rows
    ]
    return sorted(found, key=lambda r: (r.released_at, r.contract_version))


def tenants_unlearned(conn: DictConnection, run_id: UUID) -> int:
    """How many forgotten tenants the run unlearns: those its snapshot leaves out, when it is
    an unlearning run (0 for any other, whose snapshot may leave some out too)."""
    row = conn.execute(
        "SELECT cardinality(s.left_out_tenants) AS n FROM training_runs r "
        "JOIN dataset_snapshots s USING (snapshot_id) WHERE r.run_id = %s AND r.unlearning",
        (run_id,),
    ).fetchone()
    return 0 if row is None else int(row["n"])
