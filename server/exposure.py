"""Which adapters and releases learned from a tenant's records (``macaron tenants exposure``).

A record's envelope keeps its tenant, key and position after the tenant is forgotten; only its
content is gone. So exposure can be told from the log and the lineage at any time. An adapter is
exposed when one of the tenant's records lies before the end of the snapshot its run trained on,
on its specialist's experience key. That covers the snapshot and the older records a run
replays, unless the run could not read them: its snapshot leaves the tenant out (a run that
unlearns it: ``server.unlearning``), or it was queued after the tenant was forgotten.
An adapter trained from an exposed parent is exposed too. A router version is
exposed when one of the tenant's routing labels lies before the end of the labels its run was
fitted on, unless the run could not read them, likewise (a router is fitted afresh, so a
parent passes nothing on). A release is exposed when any of its adapters or its router is.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from core.experience import experience_key
from core.log import EventLog
from core.registry import TrainedAdapter, TrainedRouter
from core.routing import ROUTING_KEY
from infra.postgres.db import DictConnection
from infra.postgres.erasure import erased_adapters
from infra.postgres.exposure import (
    forgotten_times,
    release_adapters,
    trained_adapters,
    trained_routers,
)
from infra.postgres.routers import erased_routers


@dataclass(frozen=True)
class Exposure:
    records: int
    """The tenants' experience records and routing labels in the log."""
    adapters: tuple[str, ...]
    """Exposed adapter versions, as ``specialist@version``."""
    erased: tuple[str, ...]
    """The exposed adapter and router versions whose weights were erased
    (``server.erasure.erase_replaced``)."""
    routers: tuple[str, ...]
    """Exposed router versions."""
    releases: tuple[str, ...]
    active: bool
    """Whether the active release is among them."""


def exposure(conn: DictConnection, log: EventLog, tenants: Collection[str]) -> Exposure:
    """What learned from any record of ``tenants``."""
    found = _records_of(log, tenants)
    exposed = _exposed_adapters(conn, found)
    routers = _exposed_routers(conn, found)
    releases = [
        r
        for r in release_adapters(conn)
        if set(r.adapter_ids) & exposed.keys() or r.router_version in routers
    ]
    erased = erased_adapters(conn)
    routers_erased = erased_routers(conn)
    return Exposure(
        records=sum(len(spots) for spots in found.values()),
        adapters=tuple(exposed.values()),
        erased=tuple(name for i, name in exposed.items() if i in erased)
        + tuple(r for r in routers if r in routers_erased),
        routers=tuple(routers),
        releases=tuple(r.release_id for r in releases),
        active=any(r.active for r in releases),
    )


def exposed_parts(
    conn: DictConnection, log: EventLog, tenants: Collection[str]
) -> tuple[dict[int, str], list[str]]:
    """The adapter versions that learned from any record of ``tenants`` (id ->
    ``specialist@version``), and the router versions fitted on any of their labels."""
    found = _records_of(log, tenants)
    return _exposed_adapters(conn, found), _exposed_routers(conn, found)


Spot = tuple[int, int, str]
"""Where a record lies (partition, offset) and whose it is."""


def _records_of(log: EventLog, tenants: Collection[str]) -> dict[str, list[Spot]]:
    """Where the tenants' experience records and routing labels lie, by key (no tenants: no
    read of the log, which the console asks for at every load)."""
    found: dict[str, list[Spot]] = {}
    if not tenants:
        return found
    for event in log.read(types=["ExperienceRecorded", "RoutingLabelled"]):
        env = event.envelope
        if env.tenant_id in tenants:
            spot = (event.position.partition, event.position.offset, env.tenant_id)
            found.setdefault(env.key, []).append(spot)
    return found


def _could_read(
    tenant: str, made: TrainedAdapter | TrainedRouter, forgotten_at: dict[str, datetime]
) -> bool:
    """Whether the run that made an adapter or a router could read ``tenant``'s records: not
    when it left the tenant out, nor when it was queued after the tenant was forgotten (they
    read as ``Forgotten`` by then)."""
    gone = forgotten_at.get(tenant)
    queued = made.queued_at
    return tenant not in made.left_out_tenants and (gone is None or queued is None or queued < gone)


def _exposed_adapters(conn: DictConnection, found: dict[str, list[Spot]]) -> dict[int, str]:
    exposed: dict[int, str] = {}
    forgotten_at = forgotten_times(conn)
    for adapter in trained_adapters(conn):
        ends = adapter.trained_to or {}
        spots = found.get(experience_key(adapter.specialist), [])
        direct = any(
            offset < ends.get(part, 0) and _could_read(tenant, adapter, forgotten_at)
            for part, offset, tenant in spots
        )
        if direct or adapter.parent_id in exposed:
            exposed[adapter.adapter_version_id] = adapter.name
    return exposed


def _exposed_routers(conn: DictConnection, found: dict[str, list[Spot]]) -> list[str]:
    labels = found.get(ROUTING_KEY, [])
    forgotten_at = forgotten_times(conn)
    return [
        r.router_version
        for r in trained_routers(conn)
        if any(
            offset < r.labels_end.get(part, 0) and _could_read(tenant, r, forgotten_at)
            for part, offset, tenant in labels
        )
    ]
