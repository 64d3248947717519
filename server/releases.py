"""The serving release: the root release made on first start, and loading a release's adapters
into an engine and its harness from the registry.

The root release holds a version-0 adapter per specialist that computes exactly the base model
(``B = 0``), so every request names an adapter and the first successor has a parent, and
``harness@0`` (``root_harness()``: the prompts the server had before harnesses were data).
"""

from __future__ import annotations

from pathlib import Path

from core.engine import Engine, OutputConstraint
from core.errors import NoActiveRelease
from core.events import NewEvent, ReleasePromoted
from core.events.tenants import SYSTEM_TENANT
from core.harness.artifact import HarnessVersion, root_harness
from core.harness.grammars import output_constraint
from core.log import EventLog
from core.release import Release, release_id_for
from infra import observe
from infra.artifacts import ArtifactStore, load_release
from infra.identity_adapter import register_identity_adapter, store_identity_adapter
from infra.postgres.db import Pool
from infra.postgres.registry import (
    active_release,
    create_release,
    ensure_specialists,
    harness_by_name,
    lock_releases,
    register_harness,
)

RELEASES_KEY = "releases"


def ensure_root_release(
    pool: Pool,
    log: EventLog,
    store: ArtifactStore,
    model_dir: Path,
    router_version: str,
    specialists: tuple[str, ...],
) -> Release:
    """The active release; on first start, the root release (of the base model in
    ``model_dir``, known by its folder's name) is made, recorded and activated. ``harness@0``
    is registered either way: a database whose releases predate harness versions names it
    ``harness-1``, read as ``harness@0``."""
    base_model = model_dir.name
    with pool.connection() as conn:
        harness = register_harness(conn, root_harness(), parent=None)
        try:
            return active_release(conn)
        except NoActiveRelease:
            pass
    stored = {n: store_identity_adapter(store, model_dir, base_model, n) for n in specialists}
    release_id = release_id_for(
        None,
        base_model,
        router_version,
        harness.name,
        harness.spec.hcp_version,
        {name: sha for name, (sha, _) in stored.items()},
    )
    with pool.connection() as conn, conn.transaction():
        lock_releases(conn)
        try:
            return active_release(conn)
        except NoActiveRelease:
            pass
        ensure_specialists(conn, list(specialists))
        adapters = {
            name: register_identity_adapter(conn, name, sha, path, base_model)
            for name, (sha, path) in stored.items()
        }
        release = Release(
            release_id=release_id,
            parent_release_id=None,
            base_model=base_model,
            router_version=router_version,
            harness_version=harness.name,
            hcp_version=harness.spec.hcp_version,
            adapters=adapters,
        )
        create_release(conn, release, active=True)
        log.append(
            [
                NewEvent(
                    payload=ReleasePromoted(release_id=release_id, parent_release_id=None),
                    tenant_id=SYSTEM_TENANT,
                    key=RELEASES_KEY,
                )
            ]
        )
    return release


def prepare_release(
    engine: Engine, store: ArtifactStore, pool: Pool, release: Release
) -> HarnessVersion:
    """Make every adapter of ``release`` servable (``load_release``); returns the release's
    harness from the registry (checked against its address, and that this server can serve
    it), its grammars prepared."""
    with pool.connection() as conn:
        harness = harness_by_name(conn, release.harness_version)
    prepare_harness(engine, harness)
    load_release(engine, store, release)
    observe.adapters_loaded.set(len(engine.loaded_adapters()))
    return harness


def prepare_harness(engine: Engine, harness: HarnessVersion) -> None:
    """Check and compile every grammar ``harness`` enforces, for each specialist's first and
    later steps: a grammar that does not compile is a typed error here, at start or promotion,
    and no turn waits for a compile. Seconds when cold: call it off the event loop."""
    prepared: list[OutputConstraint] = []
    for name in harness.spec.specialists:
        for first in (True, False):
            constraint = output_constraint(harness.spec, name, first_step=first)
            if constraint is not None and constraint not in prepared:
                engine.prepare(constraint)
                prepared.append(constraint)
