"""The steps of the learning loop, as plain functions of a ``Runtime`` (the Celery tasks in
``learners.worker`` call them; tests may too): train a successor on a dataset snapshot,
evaluate it under the contract against its parent, and ask the serving process to promote it.

Each step is idempotent by run id: a redelivered task finds the run's state and either does
nothing or takes over a run whose lease expired (its worker died).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from opentelemetry import trace
from pydantic import TypeAdapter, ValidationError

from core.contract import Contract, Decision, decide
from core.engine import Engine
from core.errors import MacaronError
from core.events import CandidateTrained, ContractEvaluated, NewEvent, PromotionRejected
from core.experience import EMPTY_CHAIN, FILTER_VERSION, chain_record, experience_key
from core.ids import derived_id
from core.log import EventLog
from core.release import AdapterRef, Release
from core.settings import Settings
from infra import observe
from infra.artifacts import ArtifactStore
from infra.postgres.db import DictConnection, Pool
from infra.postgres.registry import (
    active_release,
    adapter_ref,
    adapter_version,
    harness_by_name,
    next_adapter_version,
    record_successor,
    register_adapter,
)
from infra.postgres.runs import (
    claim_run,
    dataset_snapshot,
    evaluated_outcomes,
    fail_run,
    finish_run,
    record_evaluation,
    renew_lease,
    run_result,
    training_run,
)
from learners.contract import load_contract, run_contract
from learners.recipes.lora import (
    PreferencePair,
    SFTExample,
    TrainingConfig,
    train_successor_adapter,
)

Progress = Callable[[int, int, dict[str, float]], None]


class RunFailed(MacaronError):
    code = "run_failed"


class RunBusy(MacaronError):
    """Another worker holds a live lease on the run: try again once it may have run out."""

    code = "run_busy"
    retryable = True


@dataclass
class Runtime:
    settings: Settings
    pool: Pool
    log: EventLog
    store: ArtifactStore
    model_dir: Path
    training: TrainingConfig
    contract_path: Path
    contract_engine: Callable[[], Engine]
    """A fresh engine on the base model, to run the contract with (closed after each run)."""


# --- training -------------------------------------------------------------------------------


def train_run(rt: Runtime, run_id: UUID, progress: Progress | None = None) -> str:
    """Train the run's successor adapter; returns its versioned name (or what is there)."""
    with rt.pool.connection() as conn, conn.transaction():
        run = claim_run(conn, run_id, "queued", rt.settings.training_lease_seconds)
        if run is None:
            done = run_result(conn, run_id)
            if done is None:
                raise RunFailed(f"no training run {run_id}")
            if done["status"] == "running":
                raise RunBusy(f"run {run_id} is being trained by a worker whose lease is live")
            return (
                f"{done['specialist']}@{done['version']}"
                if done["version"] is not None
                else str(done["status"])
            )
        snapshot = dataset_snapshot(conn, run["snapshot_id"])
        parent = adapter_version(conn, run["parent_adapter_id"])
    try:
        if snapshot is None or parent is None:
            raise RunFailed(f"run {run_id} lacks its dataset snapshot or its parent adapter")
        return _train(rt, run, snapshot, parent, _renewing(rt, run_id, progress))
    except Exception as exc:
        with rt.pool.connection() as conn, conn.transaction():
            fail_run(conn, run_id, repr(exc)[:2000])
        raise


def _renewing(rt: Runtime, run_id: UUID, progress: Progress | None) -> Progress:
    """Progress that also renews the run's lease while training goes on."""
    renewed = time.monotonic()

    def step(done: int, steps: int, losses: dict[str, float]) -> None:
        nonlocal renewed
        lease = rt.settings.training_lease_seconds
        if time.monotonic() - renewed > lease / 4:
            with rt.pool.connection() as conn, conn.transaction():
                renew_lease(conn, run_id, lease)
            renewed = time.monotonic()
        if progress is not None:
            progress(done, steps, losses)

    return step


def materialize(rt: Runtime, snapshot: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Replay the snapshot's log range: its records, and the older records of the same
    specialist (against forgetting). The records must hash to the snapshot's hash."""
    [(part, start)] = snapshot["start_positions"].items()
    [(_, end)] = snapshot["end_positions"].items()
    partition = int(part)
    records, older = [], []
    running = EMPTY_CHAIN
    key = experience_key(snapshot["specialist"])
    for event in rt.log.read(key=key, types=["ExperienceRecorded"]):
        payload: Any = event.payload
        if payload.filter_version != FILTER_VERSION or payload.kind == "trajectory":
            continue
        offset = event.position.offset
        if event.position.partition == partition and start <= offset < end:
            records.append(payload)
            running = chain_record(running, payload)
            _link_to(event.envelope.trace)
        elif offset < start:
            older.append(payload)
    if running != snapshot["content_hash"] or len(records) != snapshot["record_count"]:
        raise RunFailed(f"snapshot {snapshot['snapshot_id']} does not replay to its hash")
    return records, older


def _link_to(headers: dict[str, str]) -> None:
    """Link the current span (the training task's) to the turn a record came from."""
    link = observe.link_of(headers)
    if link is not None:
        trace.get_current_span().add_link(link.context)


def _train(
    rt: Runtime,
    run: dict[str, Any],
    snapshot: dict[str, Any],
    parent: dict[str, Any],
    progress: Progress | None,
) -> str:
    records, older = materialize(rt, snapshot)
    sft, pairs, old = _examples(records, older)
    parent_dir = rt.store.verified_path(parent["sha256"], parent["path"])
    with tempfile.TemporaryDirectory() as scratch:
        result = train_successor_adapter(
            rt.model_dir,
            parent_dir,
            Path(scratch),
            sft=sft,
            preferences=pairs,
            older=old,
            config=rt.training,
            progress=progress,
        )
        sha, stored = rt.store.put(Path(scratch))
    metrics = {
        "final_loss": result.final_loss,
        "seconds": result.seconds,
        "examples": float(result.examples),
        "pairs": float(result.pairs),
    }
    adapter = _record_candidate(rt, run, parent, sha, str(stored), metrics)
    rt.log.append(
        [
            NewEvent(
                payload=CandidateTrained(
                    run_id=run["run_id"],
                    specialist=run["specialist"],
                    adapter_version=adapter.name,
                    parent_adapter_version=f"{parent['specialist']}@{parent['version']}",
                    sha256=sha,
                    metrics=metrics,
                ),
                tenant_id="system",
                key=f"training.{run['specialist']}",
                event_id=_step_id(run["run_id"], "trained"),
            )
        ]
    )
    return adapter.name


def _examples(
    records: list[Any], older: list[Any]
) -> tuple[list[SFTExample], list[PreferencePair], list[SFTExample]]:
    """The snapshot's SFT examples and preference pairs, and the older SFT examples."""
    sft = [
        SFTExample(messages=r.record["messages"], target=r.record["target"])
        for r in records
        if r.kind == "sft"
    ]
    pairs = [
        PreferencePair(
            messages=r.record["messages"], chosen=r.record["chosen"], rejected=r.record["rejected"]
        )
        for r in records
        if r.kind == "preference"
    ]
    old = [
        SFTExample(messages=r.record["messages"], target=r.record["target"])
        for r in older
        if r.kind == "sft"
    ]
    return sft, pairs, old


def _record_candidate(
    rt: Runtime,
    run: dict[str, Any],
    parent: dict[str, Any],
    sha: str,
    path: str,
    metrics: dict[str, float],
) -> AdapterRef:
    """Register the trained adapter as the specialist's next version and finish the run."""
    with rt.pool.connection() as conn, conn.transaction():
        adapter = register_adapter(
            conn,
            specialist=run["specialist"],
            version=next_adapter_version(conn, run["specialist"]),
            parent_id=parent["adapter_version_id"],
            sha256=sha,
            path=path,
            rank=int(parent["rank"]),
            base_model=parent["base_model"],
        )
        finish_run(
            conn,
            run["run_id"],
            adapter_version_id=adapter.adapter_version_id,
            config=rt.training.model_dump(),
            metrics=metrics,
        )
    return adapter


def _step_id(run_id: UUID, step: str) -> UUID:
    return derived_id("run", run_id, step)


# --- evaluation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    passed: bool
    candidate: dict[str, float]
    parent: dict[str, float]
    reasons: list[str]
    release_id: str | None


def evaluate_run(rt: Runtime, run_id: UUID) -> Evaluation:
    """Run the contract on the candidate and its parent (same engine, same seed; the parent's
    outcomes are reused when recorded), store both, apply the rule; a pass defines the successor
    release (not yet active)."""
    with rt.pool.connection() as conn:
        run = training_run(conn, run_id)
        if run is None or run["status"] != "succeeded":
            raise RunFailed(f"run {run_id} has no trained candidate to evaluate")
        release = active_release(conn)
        candidate = _adapter(conn, run["result_adapter_id"])
    contract = load_contract(rt.contract_path)
    specialist = str(run["specialist"])
    candidate_outcomes, parent_outcomes = _contract_outcomes(
        rt, contract, release, specialist, candidate
    )
    decision = decide(candidate_outcomes, parent_outcomes, specialist, contract.rule)
    cand_scores, parent_scores = _scores(candidate_outcomes), _scores(parent_outcomes)
    successor = release.successor(adapters={specialist: candidate}) if decision.passed else None
    evaluation_id = _step_id(run_id, "evaluated")
    with rt.pool.connection() as conn, conn.transaction():
        record_evaluation(
            conn,
            evaluation_id=evaluation_id,
            run_id=run_id,
            adapter_version_id=candidate.adapter_version_id,
            contract_version=contract.version,
            scores={
                "candidate": cand_scores,
                "parent": parent_scores,
                "outcomes": {"candidate": candidate_outcomes, "parent": parent_outcomes},
                "parent_release_id": release.release_id,
                "reasons": decision.reasons,
                "p_value": decision.p_value,
            },
            passed=decision.passed,
        )
        if successor is not None:
            record_successor(conn, successor, run_id)
    rt.log.append(
        _evaluation_events(
            run_id, specialist, evaluation_id, contract, decision, cand_scores, parent_scores
        )
    )
    return Evaluation(
        decision.passed,
        cand_scores,
        parent_scores,
        decision.reasons,
        None if successor is None else successor.release_id,
    )


def _contract_outcomes(
    rt: Runtime, contract: Contract, release: Release, specialist: str, candidate: AdapterRef
) -> tuple[dict[str, list[bool]], dict[str, list[bool]]]:
    """The contract's per-task outcomes on the candidate and on the active release."""
    parents = {name: ref.name for name, ref in release.adapters.items()}
    candidates = {**parents, specialist: candidate.name}
    with rt.pool.connection() as conn:
        parent_outcomes = recorded_outcomes(conn, release.release_id, contract)
        harness = harness_by_name(conn, release.harness_version)
    engine = rt.contract_engine()
    try:
        for ref in [*release.adapters.values(), candidate]:
            engine.load_adapter(ref.name, str(rt.store.verified_path(ref.sha256, ref.path)))
        if parent_outcomes is None:
            parent_outcomes = asyncio.run(run_contract(engine, parents, contract, harness=harness))
        candidate_outcomes = asyncio.run(
            run_contract(engine, candidates, contract, harness=harness)
        )
    finally:
        engine.close()
    return candidate_outcomes, parent_outcomes


def _evaluation_events(
    run_id: UUID,
    specialist: str,
    evaluation_id: UUID,
    contract: Contract,
    decision: Decision,
    cand_scores: dict[str, float],
    parent_scores: dict[str, float],
) -> list[NewEvent]:
    """``ContractEvaluated``, and ``PromotionRejected`` when the rule did not pass."""
    events = [
        NewEvent(
            payload=ContractEvaluated(
                evaluation_id=evaluation_id,
                run_id=run_id,
                contract_version=contract.version,
                scores={
                    **{f"candidate.{k}": v for k, v in cand_scores.items()},
                    **{f"parent.{k}": v for k, v in parent_scores.items()},
                },
                passed=decision.passed,
            ),
            tenant_id="system",
            key=f"training.{specialist}",
            event_id=evaluation_id,
        )
    ]
    if not decision.passed:
        events.append(
            NewEvent(
                payload=PromotionRejected(run_id=run_id, reason="; ".join(decision.reasons)),
                tenant_id="system",
                key=f"training.{specialist}",
                event_id=_step_id(run_id, "rejected"),
            )
        )
    return events


def _scores(outcomes: dict[str, list[bool]]) -> dict[str, float]:
    """Each suite's share of tasks passed."""
    return {suite: sum(done) / len(done) for suite, done in outcomes.items() if done}


_OUTCOMES = TypeAdapter(dict[str, list[bool]])


def recorded_outcomes(
    conn: DictConnection, release_id: str, contract: Contract
) -> dict[str, list[bool]] | None:
    """The contract's per-task outcomes on a release, from an earlier evaluation under the same
    contract version (as the candidate of the run that made the release, or as the parent of a
    run), or ``None``. Greedy decoding with the same seed and budgets gives the same answers, so
    a release is scored once. A stored record that does not fit the contract is not used."""
    sizes = {suite: len(tasks) for suite, tasks in contract.suites.items()}
    for stored in evaluated_outcomes(conn, release_id, contract.version):
        try:
            outcomes = _OUTCOMES.validate_python(stored)
        except ValidationError:
            continue
        if {suite: len(done) for suite, done in outcomes.items()} == sizes:
            return outcomes
    return None


def _adapter(conn: DictConnection, adapter_version_id: int) -> AdapterRef:
    row = adapter_version(conn, adapter_version_id)
    if row is None:
        raise RunFailed(f"no adapter version {adapter_version_id}")
    return adapter_ref(row)
