"""Unlearning by replay (``macaron tenants forget TENANT --retrain``, ``DELETE
/admin/tenants/{id}?retrain=true``).

For each specialist whose active adapter learned from a forgotten tenant's records, this
queues a successor run:
- It starts from the newest ancestor of that adapter that never saw those records. That is
  the version-0 adapter at the latest.
- It trains on the range of the snapshot that made the active adapter. The forgotten
  tenants' records are left out, and the run replays the older records as every run does.
- The snapshot names the tenants it leaves out. Its hash covers only the records it keeps,
  so the worker checks it as it checks any other.

The run is then trained and evaluated like any other, but against the release it would fall
back to (the active one with the ancestor in place), needing no gain there
(``learners.evaluation.evaluate``). Its lineage and the promotion request name the forgetting.

When the active router was fitted on any of their routing labels, a router run refits it on
every label in the log up to now: the forgotten ones read as ``Forgotten`` and are not fitted.
It names the tenants it leaves out and, as an adapter's run is, is judged against the router
it would fall back to (the newest ancestor fitted on none of their labels, often the seed
router), not against the exposed one, whose labels it may not keep: on a routing suite where
those labels helped, the exposed router would otherwise refuse its own unlearning.

An adapter that learned only from forgotten tenants has nothing left to train on: its ancestor
is what unlearning gives, so those specialists' ancestors go back in place in one release
(``Unlearning.fallback``), for the caller to ask the server to promote.

Once their successors serve, what learned from them is erased (``server.erasure``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

from core.errors import MacaronError, TrainingInFlight
from core.events import (
    NewEvent,
    RouterTrainingRequested,
    RoutingLabelled,
    TrainingRequested,
    UnlearningRequested,
)
from core.events.tenants import SYSTEM_TENANT
from core.experience import EMPTY_CHAIN, chain_record, snapshot_events
from core.ids import derived_id
from core.log import EventLog
from core.registry import DatasetSnapshot, ProducingRun, QueuedRun, TrainedAdapter
from core.release import AdapterRef, Release
from core.routing import ROUTER_RUNS_KEY, ROUTING_KEY
from infra.postgres.db import DictConnection, Pool
from infra.postgres.exposure import forgotten_tenants, producing_run, trained_adapters
from infra.postgres.promotions import request_promotion
from infra.postgres.registry import active_release, adapter_version, file_release
from infra.postgres.routers import queue_router_run, router_parent, router_run
from infra.postgres.runs import queue_run, record_snapshot, run_result
from server.exposure import exposed_parts
from server.forgetting import FORGOTTEN_KEY


class ForgettingRaced(MacaronError):
    """Another tenant was forgotten while a retraining read the records to keep: asked again,
    it leaves that tenant out too (the forget itself succeeded)."""

    code = "forgetting_raced"
    retryable = True


@dataclass(frozen=True)
class Retraining:
    specialist: str
    run_id: UUID
    parent: str
    """The ancestor it starts from (``specialist@version``)."""
    records: int
    """The records it trains on (those it keeps of the snapshot)."""
    event: NewEvent
    """Its ``TrainingRequested``, for the caller to append before enqueueing the run."""


@dataclass(frozen=True)
class Unlearning:
    runs: list[Retraining]
    fallback: Release | None
    """The active release with the ancestors in place of the adapters that learned only from
    forgotten tenants (filed, not active); ``None`` when there are none."""
    restored: tuple[str, ...] = ()
    """Those ancestors (``specialist@version``)."""
    router_run: NewEvent | None = None
    """The ``RouterTrainingRequested`` of the router run that refits the active router without
    them, for the caller to append before enqueueing it; ``None`` when it never saw them."""


RACED_TRIES = 3
"""How often a retraining is tried again when another tenant is forgotten while it reads."""


def retrain_forgotten(pool: Pool, log: EventLog, *, dispatch: bool = False) -> Unlearning:
    """Queue the successors that unlearn every forgotten tenant (``queue_retraining``) and
    append their requests, with ``dispatch`` (a server, which cannot enqueue) in one append
    with the ``UnlearningRequested`` that has the processors enqueue them; else the caller
    enqueues them. The caller asks for the fallback's promotion (``promote_fallback``). A
    tenant forgotten while it reads (``ForgettingRaced``) has it read the forgotten tenants
    again and start over, ``RACED_TRIES`` times at most (then ``ForgettingRaced``, retryable)."""
    for tries in range(1, RACED_TRIES + 1):
        try:
            with pool.connection() as conn, conn.transaction():
                unlearning = queue_retraining(conn, log, forgotten_tenants(conn))
            break
        except ForgettingRaced:
            if tries == RACED_TRIES:
                raise
    router = unlearning.router_run
    events = [run.event for run in unlearning.runs] + ([] if router is None else [router])
    asked = _unlearning_requested(unlearning) if dispatch else None
    log.append(events + ([] if asked is None else [asked]))
    return unlearning


def _unlearning_requested(unlearning: Unlearning) -> NewEvent | None:
    """The ``UnlearningRequested`` that records a server's retraining for the stream processors
    to hand its runs to the workers (``streams.unlearning_dispatch``); ``None`` when nothing
    was queued or filed. Its id derives from what it names: asked again unchanged, the append
    is a no-op."""
    runs = [run.run_id for run in unlearning.runs]
    router = unlearning.router_run
    fallback = unlearning.fallback
    if not runs and router is None and fallback is None:
        return None
    asked = UnlearningRequested(
        runs=runs,
        router_run=None if router is None else router.event_id,
        fallback_release_id=None if fallback is None else fallback.release_id,
    )
    parts = [*runs, asked.router_run, asked.fallback_release_id]
    return NewEvent(
        payload=asked,
        tenant_id=SYSTEM_TENANT,
        key=FORGOTTEN_KEY,
        event_id=derived_id("unlearning", *parts),
    )


def promote_fallback(pool: Pool, fallback: Release, restored: Sequence[str], by: str) -> None:
    """Ask the server to promote ``fallback`` (``PromotionInProgress`` while another request
    is pending: the caller says to promote it once that one is done)."""
    reason = f"{by}: {', '.join(restored)} learned from no one else"
    request_promotion(pool, fallback.release_id, requested_by=reason)


def queue_retraining(conn: DictConnection, log: EventLog, forgotten: Sequence[str]) -> Unlearning:
    """Queue the successor runs and the router run (in the caller's transaction), and file
    the fallback release; none of them when nothing the active release serves learned from
    ``forgotten`` (every forgotten tenant, so that the new snapshots open). Raises
    ``TrainingInFlight`` when a specialist has a run queued or running, or a router run is."""
    exposed, routers = exposed_parts(conn, log, forgotten)
    active = active_release(conn)
    router = (
        _queue_router(conn, log, sorted(forgotten), _fallback_router(conn, active, routers))
        if active.router_version in routers
        else None
    )
    adapters = {a.adapter_version_id: a for a in trained_adapters(conn)}
    queued, fallen_back = [], {}
    for specialist, ref in sorted(active.adapters.items()):
        adapter_id = ref.adapter_version_id
        made_by = producing_run(conn, adapter_id)
        if adapter_id not in exposed or made_by is None:
            continue  # only a trained adapter (with a snapshot) can be exposed
        ancestor = adapters[adapter_id]
        while ancestor.adapter_version_id in exposed:
            assert ancestor.parent_id is not None  # version 0 is never exposed
            ancestor = adapters[ancestor.parent_id]
        retraining = _queue(conn, log, made_by, ancestor, sorted(forgotten))
        if retraining is not None:
            queued.append(retraining)
        else:
            fallen_back[specialist] = _ref(conn, ancestor.adapter_version_id)
    if not fallen_back:
        return Unlearning(queued, None, router_run=router)
    fallback = active.successor(adapters=fallen_back)
    file_release(conn, fallback)
    restored = tuple(ref.name for ref in fallen_back.values())
    return Unlearning(queued, fallback, restored, router)


def _fallback_router(conn: DictConnection, active: Release, exposed: Collection[str]) -> str | None:
    """The newest ancestor of the active router fitted on none of the forgotten tenants'
    labels (``exposed``: the routers that were), which the refit is judged against; ``None``
    when every ancestor was."""
    version = router_parent(conn, active.router_version)
    while version is not None and version in exposed:
        version = router_parent(conn, version)
    return version


def _queue_router(
    conn: DictConnection, log: EventLog, forgotten: list[str], fallback: str | None
) -> NewEvent | None:
    """Queue the router run that refits on every label up to now without ``forgotten``'s,
    judged against ``fallback`` (once per set of forgotten tenants: a rerun finds the run
    queued before, and ``None`` once that run was judged: its router was refused, the exposed
    one serves on)."""
    run_id = derived_id("router-run", "unlearning", *forgotten)
    end = log.end_positions()
    labels = log.read(key=ROUTING_KEY, end=end, types=["RoutingLabelled"])
    count = sum(isinstance(e.payload, RoutingLabelled) for e in labels)
    if not queue_router_run(conn, run_id, end, count, forgotten, fallback):
        queued = router_run(conn, run_id)
        if queued is None:
            raise TrainingInFlight("a router run is queued or running; it goes first")
        if queued.status not in ("queued", "running"):
            return None
        end, count = queued.labels_end, queued.label_count
    requested = RouterTrainingRequested(
        run_id=run_id, labels=count, labels_end={str(p): o for p, o in end.items()}
    )
    return NewEvent(
        payload=requested, tenant_id=SYSTEM_TENANT, key=ROUTER_RUNS_KEY, event_id=run_id
    )


def _ref(conn: DictConnection, adapter_version_id: int) -> AdapterRef:
    found = adapter_version(conn, adapter_version_id)
    assert found is not None  # an ancestor of a registered adapter
    return found.ref


def _queue(
    conn: DictConnection,
    log: EventLog,
    made_by: ProducingRun,
    ancestor: TrainedAdapter,
    forgotten: list[str],
) -> Retraining | None:
    specialist, recipe = made_by.snapshot.specialist, made_by.recipe
    kept = _kept_snapshot(log, made_by, forgotten)
    if kept is None:
        return None  # the tenants were all it had learned from: the ancestor stays
    snapshot, records = kept
    run_id = derived_id("run", snapshot.snapshot_id)
    record_snapshot(conn, snapshot)
    queued = queue_run(
        conn,
        QueuedRun(
            run_id=run_id,
            specialist=specialist,
            parent_adapter_id=ancestor.adapter_version_id,
            snapshot_id=snapshot.snapshot_id,
            kind="adapter",
            recipe=recipe,
            unlearning=True,
        ),
    )
    if not queued and run_result(conn, run_id) is None:
        raise TrainingInFlight(f"a run of {specialist} is queued or running; it goes first")
    parent = ancestor.name
    request = TrainingRequested(
        run_id=run_id,
        specialist=specialist,
        parent_adapter_version=parent,
        snapshot_id=snapshot.snapshot_id,
        recipe=recipe,
    )
    event = NewEvent(
        payload=request, tenant_id=SYSTEM_TENANT, key=f"training.{specialist}", event_id=run_id
    )
    return Retraining(specialist, run_id, parent, records, event)


def _kept_snapshot(
    log: EventLog, made_by: ProducingRun, forgotten: list[str]
) -> tuple[DatasetSnapshot, int] | None:
    """The range of the snapshot ``made_by`` trained on, without ``forgotten``'s records, and
    how many records it keeps; ``None`` when none of them teaches."""
    trained_on = made_by.snapshot
    specialist = trained_on.specialist
    events = snapshot_events(log, replace(trained_on, left_out_tenants=tuple(forgotten)))
    if events.forgotten:
        raise ForgettingRaced(f"{specialist}: another tenant was forgotten meanwhile; run it again")
    records: list[Any] = [event.payload for event in events.records]
    running = EMPTY_CHAIN
    for record in records:
        running = chain_record(running, record)
    teaching = sum(1 for record in records if record.kind != "trajectory")
    if not teaching:
        return None
    part, start, end = trained_on.partition, trained_on.start_offset, trained_on.end_offset
    version = trained_on.filter_version
    snapshot = replace(
        trained_on,
        snapshot_id=derived_id("snapshot", specialist, part, start, end, version, *forgotten),
        content_hash=running,
        record_count=teaching,
        left_out_tenants=tuple(forgotten),
    )
    return snapshot, len(records)
