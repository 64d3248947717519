"""Unlearning by replay (``macaron tenants forget TENANT --retrain``).

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

Once a specialist's active adapter learned from no forgotten tenant (a successor or an
ancestor was promoted in place of the exposed one), its versions that did learn from one are
erased: said so in ``adapter_erasures`` (``erase_replaced``, after each promotion), then their
folders leave the artifact store as soon as nothing may read them (``remove_erased``: not
while this server has one loaded or a server of the vLLM fleet leases one). The registry
keeps their records, so lineage still names them. A release naming one, or a version trained
from one, can be neither promoted nor rolled back to (``AdapterErased``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

from core.errors import AdapterErased, TenantForgotten, TrainingInFlight
from core.events import NewEvent, RouterTrainingRequested, RoutingLabelled, TrainingRequested
from core.events.tenants import SYSTEM_TENANT
from core.experience import EMPTY_CHAIN, chain_record, snapshot_events
from core.ids import derived_id
from core.log import EventLog
from core.registry import DatasetSnapshot, ProducingRun, QueuedRun, TrainedAdapter
from core.release import AdapterRef, Release
from core.routing import ROUTER_RUNS_KEY, ROUTING_KEY
from infra.artifacts import ArtifactStore
from infra.postgres.db import DictConnection
from infra.postgres.erasure import (
    erased_adapters,
    erased_digests,
    erased_lines,
    leased_adapters,
    record_erasures,
)
from infra.postgres.exposure import forgotten_tenants, producing_run, trained_adapters
from infra.postgres.registry import active_release, adapter_version, file_release
from infra.postgres.routers import queue_router_run, router_parent, router_run
from infra.postgres.runs import queue_run, record_snapshot, run_result
from server.exposure import exposed_parts


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
        raise TenantForgotten(f"{specialist}: another tenant was forgotten meanwhile; run it again")
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


ERASED_REASON = "learned from a forgotten tenant"


def erase_replaced(conn: DictConnection, log: EventLog) -> tuple[str, ...]:
    """Say that the weights of every adapter version that learned from a forgotten tenant are
    erased, of each specialist whose active adapter learned from none (its successor or its
    ancestor replaced the exposed one; while an exposed adapter serves, as after ``forget``
    without ``--retrain``, its line is kept whole); committed before ``remove_erased`` takes
    any file. Idempotent; returns the versions erased now."""
    exposed, _ = exposed_parts(conn, log, forgotten_tenants(conn))
    kept = {
        specialist
        for specialist, ref in active_release(conn).adapters.items()
        if ref.adapter_version_id in exposed
    }
    erased = erased_adapters(conn)
    now = {
        i: name
        for i, name in exposed.items()
        if name.rpartition("@")[0] not in kept and i not in erased
    }
    record_erasures(conn, now, ERASED_REASON)
    conn.commit()
    return tuple(sorted(now.values()))


def remove_erased(conn: DictConnection, store: ArtifactStore, busy: Collection[str]) -> int:
    """Take the folders of erased versions out of ``store``, but those a version not erased
    shares, those ``busy`` names (loaded here: turns in flight may still read them) and those
    a server sharing the vLLM fleet holds a lease on (a replica may load them again); and
    what a removal killed half-way left. Returns how many folders wait for a later call."""
    store.sweep()
    waiting = set(busy) | leased_adapters(conn)
    left = 0
    for digest, names in erased_digests(conn).items():
        if waiting.intersection(names):
            left += (store.root / digest).is_dir()
        else:
            store.remove(digest)
    return left


def check_not_erased(conn: DictConnection, release: Release) -> None:
    """``AdapterErased`` when ``release`` names an adapter version whose weights were erased,
    or one trained from such a version."""
    gone = erased_lines(conn, [ref.adapter_version_id for ref in release.adapters.values()])
    if gone:
        raise AdapterErased(
            f"{release.release_id} names "
            + "; ".join(f"{name} ({why})" for name, why in sorted(gone.items()))
        )
