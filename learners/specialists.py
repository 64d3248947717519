"""Specialists at run time (``macaron specialist add|disable|enable``), each change one release
that the running server promotes like any other:

- *add*: a version-0 adapter (computing exactly the base model) and a harness entry for the new
  specialist, and a router fitted with its examples; the examples go to the log
  (``SpecialistAdded`` on key ``specialists``), so every later router fit learns it too;
- *disable*: a router fitted without it (its adapter and harness entry stay, unused);
- *enable*: a router fitted with it again.

A specialist is enabled while the active release's router knows it. Every input is checked
before anything is written."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from core.errors import ConfigError, PromotionInProgress
from core.events import NewEvent, SpecialistAdded
from core.harness.artifact import FALLBACK_SPECIALIST, HarnessSpec, SpecialistHarness
from core.release import Release
from core.routing import (
    SPECIALISTS_KEY,
    ExamplesInvalid,
    InsufficientTrainingData,
    RouterModel,
    SpecialistExists,
    SpecialistRequired,
    UnknownSpecialist,
    specialist_name,
)
from core.routing_labels import RouterFit
from infra.identity_adapter import register_identity_adapter, store_identity_adapter
from infra.jsonl import load_jsonl
from infra.postgres.db import DictConnection
from infra.postgres.registry import (
    active_release,
    adapter_at,
    ensure_specialists,
    file_release,
    harness_by_name,
    lock_releases,
    register_harness,
)
from infra.postgres.routers import register_router, router_model
from learners.routing.training import logged_labels, router_fit
from learners.runtime import Runtime

MIN_EXAMPLES = 8
MAX_EXAMPLES = 1000
MAX_EXAMPLE_CHARS = 200_000  # all of them: they travel in one event (a Kafka message)


class Example(BaseModel):
    """One line of an examples file: a user turn the specialist should answer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    text: str = Field(min_length=1, max_length=4000)


def read_examples(path: Path) -> tuple[str, ...]:
    """The distinct example turns of a JSON-lines file, ``MIN_EXAMPLES`` to ``MAX_EXAMPLES``."""
    texts = tuple(dict.fromkeys(e.text.strip() for e in load_jsonl(path, Example, ExamplesInvalid)))
    if len(texts) < MIN_EXAMPLES:
        raise InsufficientTrainingData(
            f"{path}: {len(texts)} distinct examples; a specialist needs at least {MIN_EXAMPLES}"
        )
    if len(texts) > MAX_EXAMPLES:
        raise ExamplesInvalid(f"{path}: {len(texts)} examples; at most {MAX_EXAMPLES} are taken")
    if sum(len(t) for t in texts) > MAX_EXAMPLE_CHARS:
        raise ExamplesInvalid(f"{path}: the examples exceed {MAX_EXAMPLE_CHARS} characters")
    return texts


def _active(rt: Runtime) -> tuple[Release, RouterModel]:
    with rt.pool.connection() as conn:
        release = active_release(conn)
        return release, router_model(conn, release.router_version)


def _fitted(rt: Runtime, fit: RouterFit) -> RouterModel:
    return rt.router_trainer().retrain(logged_labels(rt.log), fit)


def add_specialist(rt: Runtime, name: str, description: str, examples: tuple[str, ...]) -> Release:
    """File the release that adds ``name``; returns it (not yet promoted)."""
    specialist_name(name)
    description = description.strip()
    if not 1 <= len(description) <= 500:
        raise ConfigError("--description must be 1 to 500 characters")
    release, router = _active(rt)
    if name in release.adapters or name in router.specialists:
        raise SpecialistExists(f"specialist {name!r} exists already")
    fit = router_fit(rt.log, router.specialists)
    fit = RouterFit(specialists=(*fit.specialists, name), added={**fit.added, name: examples})
    model = _fitted(rt, fit)
    sha, path = store_identity_adapter(rt.store, rt.model_dir, release.base_model, name)
    added = SpecialistAdded(specialist=name, description=description, examples=examples)
    rt.log.append([NewEvent(payload=added, tenant_id="system", key=SPECIALISTS_KEY)])
    with rt.pool.connection() as conn, conn.transaction():
        _still_active(conn, release)
        harness = harness_by_name(conn, release.harness_version)
        entry = SpecialistHarness(
            system_prompt=f"You are Macaron's {name} specialist: {description}"
        )
        spec = HarnessSpec.model_validate(
            {**harness.spec.model_dump(), "specialists": {**harness.spec.specialists, name: entry}}
        )
        ensure_specialists(conn, [name])
        adapter = adapter_at(conn, name, 0) or register_identity_adapter(
            conn, name, sha, path, release.base_model
        )  # added before, in a release that was not promoted: the same version 0
        register_router(conn, model, parent=router.version)
        child = release.successor(
            adapters={name: adapter},
            harness=register_harness(conn, spec, parent=harness),
            router_version=model.version,
        )
        file_release(conn, child)
    return child


def set_enabled(rt: Runtime, name: str, enabled: bool) -> Release:
    """File the release whose router may choose ``name`` (``enabled``) or not; returns it."""
    release, router = _active(rt)
    if name not in release.adapters:
        raise UnknownSpecialist(f"no specialist {name!r}: `macaron specialist list` names them")
    if enabled == (name in router.specialists):
        state = "enabled" if enabled else "disabled"
        error = SpecialistExists if enabled else UnknownSpecialist
        raise error(f"specialist {name!r} is {state} already")
    if enabled:
        names = (*router.specialists, name)
    else:
        names = tuple(n for n in router.specialists if n != name)
        if name == FALLBACK_SPECIALIST or not names:
            raise SpecialistRequired(
                f"{name!r} cannot be disabled: the router needs it"
                + (" (the harness falls back to it)" if name == FALLBACK_SPECIALIST else "")
            )
    model = _fitted(rt, router_fit(rt.log, names))
    with rt.pool.connection() as conn, conn.transaction():
        _still_active(conn, release)
        register_router(conn, model, parent=router.version)
        child = release.successor(router_version=model.version)
        file_release(conn, child)
    return child


def _still_active(conn: DictConnection, release: Release) -> None:
    """Refuse to file a child of a release another promotion replaced meanwhile."""
    lock_releases(conn)
    if active_release(conn).release_id != release.release_id:
        raise PromotionInProgress(
            f"release {release.release_id} stopped being active meanwhile; run the command again"
        )
