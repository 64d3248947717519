"""Propose a harness successor: one change to the active release's harness for a specialist
(``core.harness.proposals``), registered and announced with ``HarnessProposed``; and the
queueing of that proposal after each adapter run's decision."""

from __future__ import annotations

from uuid import UUID

from core.events import ExperienceRecorded, HarnessProposed, NewEvent, TrainingRequested
from core.experience import SFTRecord, records_of, source_of
from core.harness.artifact import Exemplar, HarnessSpec
from core.harness.proposals import RECIPE_PREFIX, changes, exemplar_of, next_change, propose
from core.ids import derived_id
from core.registry import DatasetSnapshot, QueuedRun, RunOutput, TrainingRun
from core.release import AdapterRef
from core.settings import Settings
from infra.postgres.db import DictConnection
from infra.postgres.registry import active_release, harness_by_name, register_harness
from infra.postgres.runs import finish_run, queue_run, runs_of_kind, training_run
from learners.recipes.config import TrainingConfig
from learners.runtime import RunFailed, Runtime, step_id
from learners.training.snapshots import materialize
from learners.training.train import of_sources


def propose_harness(rt: Runtime, run: TrainingRun, snapshot: DatasetSnapshot) -> str:
    """Register the harness successor a harness run proposes for its specialist: the change
    its recipe (``harness.<change>``) names, or, when that one has nothing to make, the next in
    turn (exemplars come from the snapshot's verified rollouts). Returns its name."""
    specialist = run.specialist
    with rt.pool.connection() as conn:
        parent = harness_by_name(conn, active_release(conn).harness_version)
        attempt = runs_of_kind(conn, specialist, "harness")
    examples = exemplars(
        materialize(rt.log, snapshot).records, parent.spec, specialist, rt.training
    )
    options = changes(parent.spec, specialist)
    first = next((n for n, c in enumerate(options) if RECIPE_PREFIX + c == run.recipe), 0)
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
            conn,
            run.run_id,
            RunOutput(harness_version=harness.version, config=config, metrics=metrics),
        )
    proposed = HarnessProposed(
        run_id=run.run_id,
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
                event_id=step_id(run.run_id, "proposed"),
            )
        ]
    )
    return harness.name


def exemplars(
    records: list[ExperienceRecorded],
    spec: HarnessSpec,
    specialist: str,
    config: TrainingConfig,
) -> list[Exemplar]:
    """The snapshot's verified rollout answers that fit as ``specialist``'s exemplars, of the
    sources the runs train on (``TrainingConfig.sources``: in self mode never an answer someone
    else wrote). Only rollouts: their prompts are the project's own (the task bank, sampled
    under the rollout tenant). A turn's record holds a tenant's words, which an exemplar would
    copy into the registry in plaintext, out of ``tenants forget``'s reach, and show the model
    in every tenant's prompt."""
    rollouts = [r for r in of_sources(records, config) if source_of(r) == "rollout"]
    return [
        exemplar
        for r in records_of(SFTRecord, rollouts)
        if (exemplar := exemplar_of(spec, specialist, _asked(r), r.target))
    ]


def _asked(record: SFTRecord) -> str:
    """The user's message a record's answer replies to (its last user message)."""
    users = [m.content for m in record.messages if m.role == "user"]
    return users[-1] if users else ""


def harness_run_id(run_id: UUID) -> UUID:
    """The id of the harness proposal that follows the adapter run ``run_id``."""
    return derived_id("run", run_id, "harness")


def queue_harness_run(
    conn: DictConnection, settings: Settings, run: TrainingRun, adapter: AdapterRef
) -> NewEvent | None:
    """Queue, in the transaction that decides the adapter run ``run``, the harness proposal
    for its specialist (on the same snapshot; ``adapter`` is the specialist's adapter once the
    decision takes effect); its ``TrainingRequested`` event, or ``None`` when proposals are off,
    ``run`` proposed a harness itself, or another run of the specialist is in flight. The worker
    starts it once the decision took effect."""
    if not settings.harness_proposals or run.kind == "harness":
        return None
    specialist = run.specialist
    harness = harness_by_name(conn, active_release(conn).harness_version)
    proposed_before = runs_of_kind(conn, specialist, "harness")
    recipe = RECIPE_PREFIX + next_change(harness.spec, specialist, proposed_before)
    run_id = harness_run_id(run.run_id)
    queued = queue_run(
        conn,
        QueuedRun(
            run_id=run_id,
            specialist=specialist,
            parent_adapter_id=adapter.adapter_version_id,
            snapshot_id=run.snapshot_id,
            kind="harness",
            recipe=recipe,
        ),
    )
    if not queued and training_run(conn, run_id) is None:
        return None  # a newer adapter run of the specialist is in flight: it proposes later
    requested = TrainingRequested(
        run_id=run_id,
        specialist=specialist,
        parent_adapter_version=adapter.name,
        snapshot_id=run.snapshot_id,
        recipe=recipe,
    )
    return NewEvent(
        payload=requested,
        tenant_id="system",
        key=f"training.{specialist}",
        event_id=step_id(run_id, "requested"),
    )
