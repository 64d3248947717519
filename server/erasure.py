"""Erasing what learned from forgotten tenants, once nothing serves it.

Once a specialist's active adapter learned from no forgotten tenant (a successor or an
ancestor was promoted in place of the exposed one), its versions that did learn from one are
erased: said so in ``adapter_erasures`` (``erase_replaced``, after each promotion), then their
folders leave the artifact store as soon as nothing may read them (``remove_erased``: not
while this server has one loaded or a server of the vLLM fleet leases one). The registry
keeps their records, so lineage still names them. A release naming one, or a version trained
from one, can be neither promoted nor rolled back to (``AdapterErased``).

Router versions likewise: once the active release routes with a version fitted on no forgotten
tenant's labels, the versions that were have their weights cleared in the registry, where they
live (``router_versions.model``); a release naming one is ``RouterErased``.
"""

from __future__ import annotations

from collections.abc import Collection

from core.errors import AdapterErased, RouterErased
from core.log import EventLog
from core.release import Release
from infra.artifacts import ArtifactStore
from infra.postgres.db import DictConnection
from infra.postgres.erasure import (
    erased_adapters,
    erased_digests,
    erased_lines,
    leased_adapters,
    record_erasures,
)
from infra.postgres.exposure import forgotten_tenants
from infra.postgres.registry import active_release
from infra.postgres.routers import erase_routers, erased_routers
from server.exposure import exposed_parts

ERASED_REASON = "learned from a forgotten tenant"


def erase_replaced(conn: DictConnection, log: EventLog) -> tuple[str, ...]:
    """Say that the weights of every adapter version that learned from a forgotten tenant are
    erased, of each specialist whose active adapter learned from none (its successor or its
    ancestor replaced the exposed one; while an exposed adapter serves, as after ``forget``
    without ``--retrain``, its line is kept whole); committed before ``remove_erased`` takes
    any file. The exposed router versions' weights go too, once the active router is not one
    of them. Idempotent; returns the adapter and router versions erased now."""
    exposed, routers = exposed_parts(conn, log, forgotten_tenants(conn))
    active = active_release(conn)
    kept = {
        specialist
        for specialist, ref in active.adapters.items()
        if ref.adapter_version_id in exposed
    }
    erased = erased_adapters(conn)
    now = {
        i: name
        for i, name in exposed.items()
        if name.rpartition("@")[0] not in kept and i not in erased
    }
    record_erasures(conn, now, ERASED_REASON)
    gone = [] if active.router_version in routers else erase_routers(conn, routers, ERASED_REASON)
    conn.commit()
    return tuple(sorted(now.values())) + tuple(gone)


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
    or one trained from such a version; ``RouterErased`` when its router version's were."""
    router_gone = erased_routers(conn).get(release.router_version)
    if router_gone is not None:
        raise RouterErased(
            f"{release.release_id} routes with {release.router_version} ({router_gone})"
        )
    gone = erased_lines(conn, [ref.adapter_version_id for ref in release.adapters.values()])
    if gone:
        raise AdapterErased(
            f"{release.release_id} names "
            + "; ".join(f"{name} ({why})" for name, why in sorted(gone.items()))
        )
