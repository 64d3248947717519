"""Evaluate a candidate (a trained adapter or a proposed harness, in the active release)
against its parent under the contract, record both outcomes and the verdict, and define the
successor release when the rule passes (the ``promote`` task then asks the server for it).
A release's outcomes are recorded once and reused as a later run's parent.

A run that unlearns forgotten tenants (``server.unlearning``) replaces an adapter that must go
whatever it scores, so it is judged against the release it would fall back to: the active one
with the run's parent (the newest ancestor that never saw the tenants' records) in place. It
needs no gain there, only to hold every suite, its own included, by the contract's guard."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from pydantic import TypeAdapter, ValidationError

from core.contract import Contract
from core.engine import Engine
from core.errors import ContractChanged
from core.events import ContractEvaluated, NewEvent, PromotionRejected
from core.harness.artifact import HarnessVersion, harness_name
from core.ids import uuid7
from core.registry import EvaluationRecord, TrainingRun
from core.release import AdapterRef, Release, changed_specialists
from core.sequential import Key
from infra.artifacts import load_release
from infra.postgres.db import DictConnection, Pool
from infra.postgres.registry import (
    active_release,
    adapter_version,
    file_release,
    harness_by_name,
    record_successor,
)
from infra.postgres.runs import (
    evaluated_outcomes,
    record_evaluation,
    record_release_score,
    tenants_unlearned,
    training_run,
)
from learners.evaluation.contract_runner import (
    Baseline,
    ContractRun,
    Outcome,
    Verdict,
    judge,
    load_contract,
    serve,
)
from learners.runtime import RunFailed, Runtime, step_id
from learners.training.propose import harness_run_id, queue_harness_run


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
        if run is None or run.status != "succeeded":
            raise RunFailed(f"run {run_id} has no trained candidate to evaluate")
        release = active_release(conn)
        served = harness_by_name(conn, release.harness_version)
        successor, harness = _candidate(conn, run, release, served)
        fallback = _fallback(conn, run, release)
    contract = load_contract(rt.contract_path)
    specialist = run.specialist
    parent, verdict = _judge(
        rt, contract, specialist, (release, served), (successor, harness), fallback
    )
    decision, candidate = verdict.decision, verdict.run
    evaluation_id = step_id(run_id, "evaluated")
    events = _evaluation_events(run_id, specialist, contract, verdict, parent, fallback)
    with rt.pool.connection() as conn, conn.transaction():
        record_evaluation(
            conn,
            EvaluationRecord(
                evaluation_id=evaluation_id,
                run_id=run_id,
                adapter_version_id=run.result_adapter_id,
                contract_version=contract.version,
                scores=_evaluation_record(contract, verdict, parent, fallback or release),
                passed=decision.passed,
            ),
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
    conn: DictConnection, run: TrainingRun, release: Release, served: HarnessVersion
) -> tuple[Release, HarnessVersion]:
    """The release a run's candidate would make (the active one with the run's adapter or
    harness in place) and the harness that release names."""
    made = run.result_harness_version if run.kind == "harness" else run.result_adapter_id
    if made is None:
        raise RunFailed(f"run {run.run_id} succeeded without the {run.kind} it made")
    if run.kind == "harness":
        harness = harness_by_name(conn, harness_name(made))
        return release.successor(harness=harness), harness
    adapter = _adapter(conn, made)
    return release.successor(adapters={run.specialist: adapter}), served


def _fallback(conn: DictConnection, run: TrainingRun, release: Release) -> Release | None:
    """For a run that unlearns forgotten tenants, the release it is judged against: ``release``
    with the run's parent adapter in place, filed (not active) so its outcomes are recorded
    once; ``None`` for any other run."""
    if not tenants_unlearned(conn, run.run_id):
        return None
    ancestor = _adapter(conn, run.parent_adapter_id)
    fallback = release.successor(adapters={run.specialist: ancestor})
    file_release(conn, fallback)
    return fallback


def _evaluation_record(
    contract: Contract, verdict: Verdict, parent: ContractRun, release: Release
) -> dict[str, Any]:
    """What an evaluation stores: scores (content) and format scores apart, per task too (the
    candidate's ``None`` where a task did not run), each side's digest, and where the rule
    stopped."""
    candidate, decision = verdict.run, verdict.decision
    tasks = contract.task_keys()
    sides = {"candidate": candidate, "parent": parent}
    return {
        "candidate": candidate.scores(),
        "parent": parent.scores(),
        "formats": {side: run.format_scores() for side, run in sides.items()},
        "calls": {side: run.call_rates(contract) for side, run in sides.items()},
        "outcomes": {side: run.passed for side, run in sides.items()},
        "well_formed": {side: run.well_formed for side, run in sides.items()},
        "tasks": tasks,
        "digests": {side: run.digest(contract.version, tasks) for side, run in sides.items()},
        "inherited": {"candidate": candidate.inherited},
        "sequential": {
            **verdict.stop.model_dump(),
            "tasks_run": verdict.tasks_run,
            "tasks_planned": verdict.tasks_planned,
        },
        "parent_release_id": release.release_id,
        "reasons": decision.reasons,
        "p_value": decision.p_value,
        "guard_p_values": decision.guard_p_values,
    }


def _judge(
    rt: Runtime,
    contract: Contract,
    specialist: str,
    active: tuple[Release, HarnessVersion],
    candidate: tuple[Release, HarnessVersion],
    fallback: Release | None,
) -> tuple[ContractRun, Verdict]:
    """The parent's outcomes (the active release's, or an unlearning run's ``fallback``'s; as
    recorded, the tasks no record holds run once and recorded), and the candidate judged
    against them: it runs only the tasks of the specialists its change can touch (every task
    with ``full_evaluation`` set), look by look, until the verdict is known. Adapters loaded
    here that the active release does not serve are unloaded afterwards."""
    parent = active if fallback is None else (fallback, active[1])
    engine = rt.contract_engine()
    loaded: set[str] = set()
    try:
        for release, _ in (active, parent, candidate):
            loaded.update(load_release(engine, rt.store, release))
        shared = _shared(rt, contract, active, parent)
        before = release_outcomes(rt.pool, engine, *parent, contract, shared)
        verdict = asyncio.run(
            judge(
                engine,
                {name: ref.name for name, ref in candidate[0].adapters.items()},
                contract,
                candidate[1],
                Baseline(
                    before,
                    None if rt.settings.full_evaluation else changed_specialists(parent, candidate),
                    specialist,
                    needs_gain=fallback is None,
                ),
            )
        )
    finally:
        serving = {ref.name for ref in active[0].adapters.values()}
        for name in loaded - serving:  # a shared fleet keeps what the server serves
            engine.unload_adapter(name)
        engine.close()
    return before, verdict


def _shared(
    rt: Runtime,
    contract: Contract,
    active: tuple[Release, HarnessVersion],
    parent: tuple[Release, HarnessVersion],
) -> dict[Key, Outcome]:
    """The active release's recorded outcomes on the tasks whose answers ``parent`` shares
    (those of the specialists it does not change; none when ``parent`` is the active one)."""
    changed = changed_specialists(active, parent)
    if parent[0] == active[0] or changed is None:
        return {}
    with rt.pool.connection() as conn:
        recorded = recorded_outcomes(conn, active[0].release_id, contract)
    known = {} if recorded is None else recorded.outcomes()
    return {
        (suite, i): outcome
        for (suite, i), outcome in known.items()
        if contract.suites[suite][i].specialist not in changed
    }


def _evaluation_events(
    run_id: UUID,
    specialist: str,
    contract: Contract,
    verdict: Verdict,
    parent: ContractRun,
    fallback: Release | None,
) -> list[NewEvent]:
    """``ContractEvaluated``, and ``PromotionRejected`` when the rule did not pass (for an
    unlearning run, naming the release it was judged against, which a rollback may serve)."""
    decision, candidate = verdict.decision, verdict.run
    evaluation_id = step_id(run_id, "evaluated")
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
        reason = "; ".join(decision.reasons)
        if fallback is not None:
            ancestor = fallback.adapters[specialist].name
            reason = f"unlearning run judged against {fallback.release_id} ({ancestor}): {reason}"
        events.append(
            NewEvent(
                payload=PromotionRejected(run_id=run_id, reason=reason),
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
    shared: Mapping[Key, Outcome] | None = None,
) -> ContractRun:
    """The contract's per-task outcomes on ``release`` served with ``harness`` (the adapters
    it names loaded in ``engine``): as recorded, with the tasks no record holds taken from
    ``shared`` (outcomes known to be the same) or run on ``engine``, and then recorded whole,
    so that a later evaluation with this release as the parent reuses them."""
    with pool.connection() as conn:
        recorded = recorded_outcomes(conn, release.release_id, contract)
    if recorded is not None and not recorded.missing():
        return recorded
    known = {**(shared or {}), **({} if recorded is None else recorded.outcomes())}
    missing = [
        (suite, i)
        for suite, tasks in contract.suites.items()
        for i in range(len(tasks))
        if (suite, i) not in known
    ]
    adapters = {name: ref.name for name, ref in release.adapters.items()}
    known |= asyncio.run(serve(engine, adapters, contract, missing, harness=harness))
    outcomes = ContractRun.of(contract, known)
    tasks = contract.task_keys()
    digest = outcomes.digest(contract.version, tasks)
    with pool.connection() as conn:
        record_release_score(
            conn,
            evaluation_id=uuid7(),  # a record found changed stays, as evidence, beside it
            release_id=release.release_id,
            contract_version=contract.version,
            scores={
                "release": outcomes.scores(),
                "formats": {"release": outcomes.format_scores()},
                "calls": {"release": outcomes.call_rates(contract)},
                "outcomes": {"release": outcomes.passed},
                "well_formed": {"release": outcomes.well_formed},
                "tasks": tasks,
                "digests": {"release": digest},
            },
        )
    return outcomes


_KNOWN = TypeAdapter(dict[str, list[bool | None]])
_TASKS = TypeAdapter(dict[str, list[str]])


def recorded_outcomes(
    conn: DictConnection, release_id: str, contract: Contract
) -> ContractRun | None:
    """The contract's per-task outcomes on a release from every earlier record under the same
    contract version (as the candidate of the run that made it, possibly stopped early, as the
    parent of a run, or scored on its own), merged; ``None`` when there is none. Greedy decoding
    with the same seed and budgets gives the same answers, so a task is run once per release.

    Outcomes are matched to tasks by content (``Task.key``), not by place: a task whose content
    no record holds is run. A record whose digest does not match its outcomes and tasks, or
    that names no tasks (before contract 5), is not used. A record of this version got on
    other tasks is ``ContractChanged``: the version's file changed without a new version."""
    expected = contract.task_keys()
    places = {key: (suite, i) for suite, keys in expected.items() for i, key in enumerate(keys)}
    known: dict[Key, Outcome] = {}
    for stored in evaluated_outcomes(conn, release_id, contract.version):
        try:
            run = ContractRun(
                _KNOWN.validate_python(stored.outcomes),
                _KNOWN.validate_python(stored.well_formed),
            )
            tasks = _TASKS.validate_python(stored.tasks)
        except ValidationError:
            continue
        if stored.digest != run.digest(contract.version, tasks) or not _fits(run, tasks):
            continue
        _same_tasks(contract.version, expected, tasks)
        for (suite, index), outcome in run.outcomes().items():
            known.setdefault(places[tasks[suite][index]], outcome)
    return ContractRun.of(contract, known) if known else None


def _fits(run: ContractRun, tasks: Mapping[str, list[str]]) -> bool:
    """Whether a record's outcomes have one entry per task it names."""
    sizes = {suite: len(keys) for suite, keys in tasks.items()}
    return all(
        {suite: len(done) for suite, done in side.items()} == sizes
        for side in (run.passed, run.well_formed)
    )


def _same_tasks(
    version: str, expected: Mapping[str, list[str]], tasks: Mapping[str, list[str]]
) -> None:
    """``ContractChanged`` naming the tasks of a record under ``version`` that the contract
    (its tasks ``expected``) does not hold as they were, or holds and the record does not."""
    stored = {key for keys in tasks.values() for key in keys}
    current = {key for keys in expected.values() for key in keys}
    changed = sorted({key.split(":", 1)[0] for key in stored ^ current})
    if changed:
        raise ContractChanged(
            f"{version} was scored before on other tasks than its file holds now "
            f"({', '.join(changed)}): a changed contract needs a new version"
        )


def _adapter(conn: DictConnection, adapter_version_id: int) -> AdapterRef:
    found = adapter_version(conn, adapter_version_id)
    if found is None:
        raise RunFailed(f"no adapter version {adapter_version_id}")
    return found.ref
