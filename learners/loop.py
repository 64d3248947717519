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
from core.events import (
    CandidateTrained,
    ContractEvaluated,
    HarnessProposed,
    NewEvent,
    PromotionRejected,
    TrainingRequested,
)
from core.experience import EMPTY_CHAIN, chain_record, first_step, snapshot_events
from core.harness.artifact import HarnessVersion, harness_name
from core.harness.proposals import RECIPE_PREFIX, changes, exemplar_of, next_change, propose
from core.ids import derived_id
from core.log import EventLog
from core.release import AdapterRef, Release
from core.routing import RouterTrainer
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
    register_harness,
)
from infra.postgres.runs import (
    claim_run,
    dataset_snapshot,
    evaluated_outcomes,
    fail_run,
    finish_run,
    queue_run,
    record_evaluation,
    record_release_score,
    renew_lease,
    run_result,
    runs_with_recipe_prefix,
    training_run,
)
from learners.contract import ContractRun, load_contract, run_contract
from learners.recipes.lora import (
    LiveSample,
    PreferencePair,
    RolloutGroup,
    SFTExample,
    TrainingConfig,
    train_successor_adapter,
)

Progress = Callable[[int, int, dict[str, float]], None]


class RunFailed(MacaronError):
    code = "run_failed"


class SnapshotMismatch(RunFailed):
    """A snapshot's records, read back from the log, no longer chain to its hash."""

    code = "snapshot_mismatch"


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
    router_trainer: Callable[[], RouterTrainer]
    """A fresh router trainer on the seed examples (it embeds with the router's model)."""
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
            if done["harness_version"] is not None:
                return harness_name(done["harness_version"])
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
        if str(run["recipe"]).startswith(RECIPE_PREFIX):
            return _propose(rt, run, snapshot)
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


@dataclass(frozen=True)
class Replayed:
    """A snapshot's records, the specialist's older records (against forgetting), and how
    many tenants the snapshot's records came from (lineage counts them, never shows them)."""

    records: list[Any]
    older: list[Any]
    tenants: int


def materialize(log: EventLog, snapshot: dict[str, Any]) -> Replayed:
    """Replay the snapshot's log range and the older records of the same specialist. The
    records must hash to the snapshot's hash, and as many of them teach as it counted (live
    rewards are hashed, not counted: ``streams.trigger``)."""
    events = snapshot_events(log, snapshot)
    records: list[Any] = [event.payload for event in events.records]
    running = EMPTY_CHAIN
    for event, record in zip(events.records, records, strict=True):
        running = chain_record(running, record)
        _link_to(event.envelope.trace)
    teaching = sum(1 for r in records if r.kind != "trajectory")
    if running != snapshot["content_hash"] or teaching != snapshot["record_count"]:
        raise SnapshotMismatch(
            f"snapshot {snapshot['snapshot_id']} does not replay to its hash: its "
            f"{snapshot['filter_version']} records chain to {running[:12]} ({teaching} teaching), "
            f"it was defined as {snapshot['content_hash'][:12]} ({snapshot['record_count']})"
        )
    tenants = {event.envelope.tenant_id for event in events.records}
    return Replayed(records, [event.payload for event in events.older], len(tenants))


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
    replayed = materialize(rt.log, snapshot)
    examples = training_examples(
        replayed.records, replayed.older, f"{parent['specialist']}@{parent['version']}"
    )
    parent_dir = rt.store.verified_path(parent["sha256"], parent["path"])
    with tempfile.TemporaryDirectory() as scratch:
        result = train_successor_adapter(
            rt.model_dir,
            parent_dir,
            Path(scratch),
            sft=examples.sft,
            preferences=examples.pairs,
            older=examples.older,
            config=rt.training,
            groups=examples.groups,
            live=examples.live,
            progress=progress,
        )
        sha, stored = rt.store.put(Path(scratch))
    metrics = {
        "final_loss": result.final_loss,
        "seconds": result.seconds,
        "examples": float(result.examples),
        "pairs": float(result.pairs),
        "samples": float(result.samples),
        "tenants": float(replayed.tenants),
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


def _propose(rt: Runtime, run: dict[str, Any], snapshot: dict[str, Any]) -> str:
    """Register the harness successor a ``harness.<change>`` run proposes for its specialist
    (exemplars come from the snapshot's verified records); when that change has nothing to
    make, the next one in turn is made. Returns its name."""
    specialist = str(run["specialist"])
    with rt.pool.connection() as conn:
        parent = harness_by_name(conn, active_release(conn).harness_version)
        attempt = runs_with_recipe_prefix(conn, specialist, RECIPE_PREFIX)
    examples = [
        exemplar
        for r in materialize(rt.log, snapshot).records
        if r.kind == "sft"
        and (exemplar := exemplar_of(parent.spec, specialist, _asked(r.record), r.record["target"]))
    ]
    options = changes(parent.spec, specialist)
    first = next((n for n, c in enumerate(options) if RECIPE_PREFIX + c == run["recipe"]), 0)
    for change in options[first:] + options[:first]:
        spec = propose(parent.spec, specialist, change, examples=examples, attempt=attempt)
        if spec is not None:
            break
    else:
        raise RunFailed(f"no harness change to propose for {specialist}")
    with rt.pool.connection() as conn, conn.transaction():
        harness = register_harness(conn, spec, parent=parent)
        metrics = {"exemplars_found": float(len(examples))}
        config = {"change": change}
        finish_run(
            conn, run["run_id"], harness_version=harness.version, config=config, metrics=metrics
        )
    proposed = HarnessProposed(
        run_id=run["run_id"],
        specialist=specialist,
        harness_version=harness.name,
        parent_harness_version=parent.name,
        change=change,
        sha256=harness.sha256,
    )
    rt.log.append(
        [
            NewEvent(
                payload=proposed,
                tenant_id="system",
                key=f"training.{specialist}",
                event_id=_step_id(run["run_id"], "proposed"),
            )
        ]
    )
    return harness.name


def _asked(record: dict[str, Any]) -> str:
    """The user's message a record's answer replies to (its last user message)."""
    users = [m["content"] for m in record["messages"] if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def harness_run_id(run_id: UUID) -> UUID:
    """The id of the harness proposal that follows the adapter run ``run_id``."""
    return derived_id("run", run_id, "harness")


def _queue_harness_run(
    conn: DictConnection, settings: Settings, run: dict[str, Any], adapter: AdapterRef
) -> NewEvent | None:
    """Queue, in the transaction that decides the adapter run ``run``, the harness proposal
    for its specialist (on the same snapshot; ``adapter`` is the specialist's adapter once the
    decision takes effect); its ``TrainingRequested`` event, or ``None`` when proposals are off,
    ``run`` proposed a harness itself, or another run of the specialist is in flight. The worker
    starts it once the decision took effect."""
    if not settings.harness_proposals or str(run["recipe"]).startswith(RECIPE_PREFIX):
        return None
    specialist = str(run["specialist"])
    harness = harness_by_name(conn, active_release(conn).harness_version)
    proposed_before = runs_with_recipe_prefix(conn, specialist, RECIPE_PREFIX)
    recipe = RECIPE_PREFIX + next_change(harness.spec, specialist, proposed_before)
    run_id = harness_run_id(run["run_id"])
    queued = queue_run(
        conn,
        run_id=run_id,
        specialist=specialist,
        parent_adapter_id=adapter.adapter_version_id,
        snapshot_id=run["snapshot_id"],
        recipe=recipe,
    )
    if not queued and training_run(conn, run_id) is None:
        return None  # a newer adapter run of the specialist is in flight: it proposes later
    requested = TrainingRequested(
        run_id=run_id,
        specialist=specialist,
        parent_adapter_version=adapter.name,
        snapshot_id=run["snapshot_id"],
        recipe=recipe,
    )
    return NewEvent(
        payload=requested,
        tenant_id="system",
        key=f"training.{specialist}",
        event_id=_step_id(run_id, "requested"),
    )


@dataclass(frozen=True)
class Examples:
    """What a snapshot trains on, by kind, and the older SFT examples replayed beside it."""

    sft: list[SFTExample]
    pairs: list[PreferencePair]
    groups: list[RolloutGroup]
    live: list[LiveSample]
    older: list[SFTExample]


def training_examples(records: list[Any], older: list[Any], parent: str) -> Examples:
    """The snapshot's SFT examples, preference pairs, and the rollout groups and live rewards
    of answers ``parent`` gave (a policy gradient's ratio and KL are taken to the policy that
    drew the answers; a live reward trains the turn's first step), and the older SFT
    examples."""
    return Examples(
        sft=[
            SFTExample(messages=r.record["messages"], target=r.record["target"])
            for r in records
            if r.kind == "sft"
        ],
        pairs=[
            PreferencePair(
                messages=r.record["messages"],
                chosen=r.record["chosen"],
                rejected=r.record["rejected"],
            )
            for r in records
            if r.kind == "preference"
        ],
        groups=[
            RolloutGroup(
                messages=r.record["messages"],
                answers=[s["answer"] for s in r.record["samples"]],
                rewards=[s["reward"] for s in r.record["samples"]],
            )
            for r in records
            if r.kind == "group" and r.record["adapter_version"] == parent
        ],
        live=[
            LiveSample(
                messages=r.record["messages"],
                answer=first_step(r.record["actions"], r.record["answer"]),
                reward=r.record["reward"],
            )
            for r in _latest_per_turn(records)
            if r.record["adapter_version"] == parent
        ],
        older=[
            SFTExample(messages=r.record["messages"], target=r.record["target"])
            for r in older
            if r.kind == "sft"
        ],
    )


def _latest_per_turn(records: list[Any]) -> list[Any]:
    """The live rewards, one per turn: the latest (a user's thumbs-down after a valid GenUI
    tree says more than the validity did)."""
    latest = {r.turn_id: r for r in records if r.kind == "trajectory"}
    return list(latest.values())


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
    evaluation_id = _step_id(run_id, "evaluated")
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
        follow_up = None if adapter is None else _queue_harness_run(conn, rt.settings, run, adapter)
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
    if run["result_harness_version"] is not None:
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
    them, if one did) and on the candidate, each served with its harness. What must run runs on
    one engine at once, so the parent's and the candidate's tasks share batches; adapters it
    loaded that the parent (the active release) does not serve are unloaded afterwards."""
    with rt.pool.connection() as conn:
        recorded = recorded_outcomes(conn, parent[0].release_id, contract)
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
                event_id=_step_id(run_id, "rejected"),
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
