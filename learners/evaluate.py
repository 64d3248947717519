"""Evaluate a candidate (a trained adapter or a proposed harness, in the active release)
against its parent under the contract, record both outcomes and the verdict, and define the
successor release when the rule passes (the ``promote`` task then asks the server for it).
A release's outcomes are recorded once and reused as a later run's parent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from pydantic import TypeAdapter, ValidationError

from core.contract import Contract, Decision, decide
from core.engine import Engine
from core.events import ContractEvaluated, NewEvent, PromotionRejected
from core.harness.artifact import HarnessVersion, harness_name
from core.ids import derived_id
from core.release import AdapterRef, Release, changed_specialists
from infra.postgres.db import DictConnection, Pool
from infra.postgres.registry import (
    active_release,
    adapter_ref,
    adapter_version,
    harness_by_name,
    record_successor,
)
from infra.postgres.runs import (
    evaluated_outcomes,
    record_evaluation,
    record_release_score,
    training_run,
)
from learners.contract_runner import ContractRun, Inheritance, load_contract, run_contract
from learners.propose import harness_run_id, queue_harness_run
from learners.runtime import RunFailed, Runtime, step_id


@dataclass(frozen=True)
class Evaluation:
    passed: bool
    candidate: dict[str, float]
    parent: dict[str, float]
    reasons: list[str]
    release_id: str | None
    proposal: UUID | None
    """The harness run queued to follow this adapter run, started once the decision took
    effect (at once after a rejection, after the promotion otherwise)."""


def evaluate_run(rt: Runtime, run_id: UUID) -> Evaluation:
    """Run the contract on the candidate (a trained adapter or a proposed harness, in the
    active release) and on the active release (same seed; the parent's outcomes are reused when
    recorded), store both, apply the rule; a pass defines the successor release (not yet
    active). After an adapter run, the harness proposal for its specialist is queued."""
    with rt.pool.connection() as conn:
        run = training_run(conn, run_id)
        if run is None or run["status"] != "succeeded":
            raise RunFailed(f"run {run_id} has no trained candidate to evaluate")
        release = active_release(conn)
        served = harness_by_name(conn, release.harness_version)
        successor, harness = _candidate(conn, run, release, served)
    contract = load_contract(rt.contract_path)
    specialist = str(run["specialist"])
    parent, candidate = _contract_runs(rt, contract, (release, served), (successor, harness))
    decision = decide(candidate.passed, parent.passed, specialist, contract.rule)
    evaluation_id = step_id(run_id, "evaluated")
    events = _evaluation_events(
        run_id, specialist, evaluation_id, contract, decision, candidate, parent
    )
    with rt.pool.connection() as conn, conn.transaction():
        record_evaluation(
            conn,
            evaluation_id=evaluation_id,
            run_id=run_id,
            adapter_version_id=run["result_adapter_id"],
            contract_version=contract.version,
            scores=_evaluation_record(candidate, parent, release, decision),
            passed=decision.passed,
        )
        if decision.passed:
            record_successor(conn, successor, run_id)
        adapter = (successor if decision.passed else release).adapter_for(specialist)
        follow_up = None if adapter is None else queue_harness_run(conn, rt.settings, run, adapter)
    rt.log.append(events if follow_up is None else [*events, follow_up])
    return Evaluation(
        decision.passed,
        candidate.scores(),
        parent.scores(),
        decision.reasons,
        successor.release_id if decision.passed else None,
        None if follow_up is None else harness_run_id(run_id),
    )


def _candidate(
    conn: DictConnection, run: dict[str, Any], release: Release, served: HarnessVersion
) -> tuple[Release, HarnessVersion]:
    """The release a run's candidate would make (the active one with the run's adapter or
    harness in place) and the harness that release names."""
    if run["kind"] == "harness":
        harness = harness_by_name(conn, harness_name(run["result_harness_version"]))
        return release.successor(harness=harness), harness
    adapter = _adapter(conn, run["result_adapter_id"])
    return release.successor(adapters={str(run["specialist"]): adapter}), served


def _evaluation_record(
    candidate: ContractRun, parent: ContractRun, release: Release, decision: Decision
) -> dict[str, Any]:
    """What an evaluation stores: scores (content) and format scores apart, per task too."""
    return {
        "candidate": candidate.scores(),
        "parent": parent.scores(),
        "formats": {"candidate": candidate.format_scores(), "parent": parent.format_scores()},
        "outcomes": {"candidate": candidate.passed, "parent": parent.passed},
        "well_formed": {"candidate": candidate.well_formed, "parent": parent.well_formed},
        "inherited": {"candidate": candidate.inherited},
        "parent_release_id": release.release_id,
        "reasons": decision.reasons,
        "p_value": decision.p_value,
    }


def _contract_runs(
    rt: Runtime,
    contract: Contract,
    parent: tuple[Release, HarnessVersion],
    candidate: tuple[Release, HarnessVersion],
) -> tuple[ContractRun, ContractRun]:
    """The contract's per-task outcomes on the parent release (as an earlier evaluation recorded
    them, if one did) and on the candidate, each served with its harness. With the parent's
    outcomes recorded, the candidate runs only the tasks of the specialists its change can
    touch and inherits the rest; otherwise both run in full. What must run runs on one engine
    at once, so the parent's and the candidate's tasks share batches; adapters it loaded that
    the parent (the active release) does not serve are unloaded afterwards."""
    with rt.pool.connection() as conn:
        recorded = recorded_outcomes(conn, parent[0].release_id, contract)
    changed = changed_specialists(parent, candidate)
    inherit = None
    if recorded is not None and changed is not None:
        inherit = Inheritance(recorded, changed)
    sides = [candidate] if recorded is not None else [parent, candidate]
    engine = rt.contract_engine()
    loaded: set[str] = set()
    try:
        for release, _ in sides:
            for ref in release.adapters.values():
                if ref.name not in engine.loaded_adapters():
                    path = rt.store.verified_path(ref.sha256, ref.path)
                    engine.load_adapter(ref.name, str(path))
                    loaded.add(ref.name)

        async def run_all() -> list[ContractRun]:
            return await asyncio.gather(
                *(
                    run_contract(
                        engine,
                        {name: ref.name for name, ref in release.adapters.items()},
                        contract,
                        harness=harness,
                        inherit=inherit,  # only set when the candidate runs alone
                    )
                    for release, harness in sides
                )
            )

        runs = asyncio.run(run_all())
    finally:
        serving = {ref.name for ref in parent[0].adapters.values()}
        for name in loaded - serving:  # a shared fleet keeps what the server serves
            engine.unload_adapter(name)
        engine.close()
    return (recorded if recorded is not None else runs[0], runs[-1])


def _evaluation_events(
    run_id: UUID,
    specialist: str,
    evaluation_id: UUID,
    contract: Contract,
    decision: Decision,
    candidate: ContractRun,
    parent: ContractRun,
) -> list[NewEvent]:
    """``ContractEvaluated``, and ``PromotionRejected`` when the rule did not pass."""
    events = [
        NewEvent(
            payload=ContractEvaluated(
                evaluation_id=evaluation_id,
                run_id=run_id,
                contract_version=contract.version,
                scores={
                    **{f"candidate.{k}": v for k, v in candidate.scores().items()},
                    **{f"parent.{k}": v for k, v in parent.scores().items()},
                    **{f"candidate.format.{k}": v for k, v in candidate.format_scores().items()},
                    **{f"parent.format.{k}": v for k, v in parent.format_scores().items()},
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
                event_id=step_id(run_id, "rejected"),
            )
        )
    return events


def release_outcomes(
    pool: Pool,
    engine: Engine,
    release: Release,
    harness: HarnessVersion,
    contract: Contract,
) -> ContractRun:
    """The contract's per-task outcomes on ``release`` served with ``harness`` (the adapters
    it names loaded in ``engine``): as recorded, or else run on ``engine`` and recorded, so
    that the loop's next evaluation with this release as the parent reuses them."""
    with pool.connection() as conn:
        recorded = recorded_outcomes(conn, release.release_id, contract)
    if recorded is not None:
        return recorded
    adapters = {name: ref.name for name, ref in release.adapters.items()}
    outcomes = asyncio.run(run_contract(engine, adapters, contract, harness=harness))
    with pool.connection() as conn:
        record_release_score(
            conn,
            evaluation_id=derived_id("release-score", release.release_id, contract.version),
            release_id=release.release_id,
            contract_version=contract.version,
            scores={
                "release": outcomes.scores(),
                "formats": {"release": outcomes.format_scores()},
                "outcomes": {"release": outcomes.passed},
                "well_formed": {"release": outcomes.well_formed},
            },
        )
    return outcomes


_PASSED = TypeAdapter(dict[str, list[bool]])
_FORMED = TypeAdapter(dict[str, list[bool | None]])


def recorded_outcomes(
    conn: DictConnection, release_id: str, contract: Contract
) -> ContractRun | None:
    """The contract's per-task outcomes on a release, from an earlier evaluation under the same
    contract version (as the candidate of the run that made the release, or as the parent of a
    run), or ``None``. Greedy decoding with the same seed and budgets gives the same answers, so
    a release is scored once. A stored record that does not fit the contract is not used."""
    sizes = {suite: len(tasks) for suite, tasks in contract.suites.items()}
    for stored in evaluated_outcomes(conn, release_id, contract.version):
        try:
            run = ContractRun(
                _PASSED.validate_python(stored["outcomes"]),
                _FORMED.validate_python(stored["well_formed"]),
            )
        except ValidationError:
            continue
        if all(
            {suite: len(done) for suite, done in outcomes.items()} == sizes
            for outcomes in (run.passed, run.well_formed)
        ):
            return run
    return None


def _adapter(conn: DictConnection, adapter_version_id: int) -> AdapterRef:
    row = adapter_version(conn, adapter_version_id)
    if row is None:
        raise RunFailed(f"no adapter version {adapter_version_id}")
    return adapter_ref(row)
