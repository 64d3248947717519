"""Which adapters and releases learned from a tenant's records (``macaron tenants exposure``).

A record's envelope keeps its tenant, key and position after the tenant is forgotten; only its
content is gone. So exposure can be told from the log and the lineage at any time. An adapter is
exposed when one of the tenant's records lies before the end of the snapshot its run trained on,
on its specialist's experience key. That covers the snapshot and the older records a run
replays. An adapter trained from an exposed parent is exposed too. A release is exposed when
any of its adapters is.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from core.experience import experience_key
from core.log import EventLog
from infra.postgres.db import DictConnection
from infra.postgres.exposure import release_adapters, trained_adapters


@dataclass(frozen=True)
class Exposure:
    records: int
    """The tenants' experience records in the log."""
    adapters: tuple[str, ...]
    """Exposed adapter versions, as ``specialist@version``."""
    releases: tuple[str, ...]
    active: bool
    """Whether the active release is among them."""


def exposure(conn: DictConnection, log: EventLog, tenants: Collection[str]) -> Exposure:
    """What learned from any record of ``tenants``."""
    records, exposed = exposed_adapters(conn, log, tenants)
    releases = [r for r in release_adapters(conn) if set(r["adapter_ids"]) & exposed.keys()]
    return Exposure(
        records=records,
        adapters=tuple(exposed.values()),
        releases=tuple(r["release_id"] for r in releases),
        active=any(r["active"] for r in releases),
    )


def exposed_adapters(
    conn: DictConnection, log: EventLog, tenants: Collection[str]
) -> tuple[int, dict[int, str]]:
    """How many experience records ``tenants`` have in the log, and the adapter versions that
    learned from any of them (id -> ``specialist@version``)."""
    found: dict[str, list[tuple[int, int]]] = {}
    for event in log.read(types=["ExperienceRecorded"]):
        env = event.envelope
        if env.tenant_id in tenants:
            spot = (event.position.partition, event.position.offset)
            found.setdefault(env.key, []).append(spot)
    exposed: dict[int, str] = {}
    for adapter in trained_adapters(conn):
        ends = adapter["end_positions"] or {}
        spots = found.get(experience_key(adapter["specialist"]), [])
        direct = any(offset < ends.get(str(part), 0) for part, offset in spots)
        if direct or adapter["parent_id"] in exposed:
            name = f"{adapter['specialist']}@{adapter['version']}"
            exposed[adapter["adapter_version_id"]] = name
    return sum(len(spots) for spots in found.values()), exposed
