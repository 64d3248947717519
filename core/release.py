"""Releases: immutable model-harness pairs, and the adapter versions they serve."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from core.canonical import canonical_json, sha256_hex
from core.errors import HarnessInvalid
from core.harness.artifact import HarnessVersion, harness_number


class AdapterRef(BaseModel):
    """One immutable adapter version: where its content-addressed weights are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    adapter_version_id: int
    specialist: str
    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    path: str
    rank: int = Field(ge=1)

    @property
    def name(self) -> str:
        """The versioned name engines serve it under (``coding@7``); never reused."""
        return f"{self.specialist}@{self.version}"


class Release(BaseModel):
    """A model-harness pair: an adapter per specialist and the harness version it names
    (``harness@N``; releases made before harnesses were data say ``harness-1``, read as
    ``harness@0``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str
    parent_release_id: str | None
    base_model: str
    router_version: str
    harness_version: str
    hcp_version: str
    adapters: dict[str, AdapterRef]

    def adapter_for(self, specialist: str) -> AdapterRef | None:
        return self.adapters.get(specialist)

    def successor(
        self,
        *,
        adapters: Mapping[str, AdapterRef] | None = None,
        harness: HarnessVersion | None = None,
        router_version: str | None = None,
    ) -> Release:
        """The child this release would promote: ``adapters`` replace those of the specialists
        they name, ``harness`` (a registered version) replaces the harness, ``router_version``
        (a registered one) the router; any of them."""
        served = {**self.adapters, **(adapters or {})}
        router = self.router_version if router_version is None else router_version
        harness_version = self.harness_version if harness is None else harness.name
        hcp_version = self.hcp_version if harness is None else harness.spec.hcp_version
        release_id = release_id_for(
            self.release_id,
            self.base_model,
            router,
            harness_version,
            hcp_version,
            {name: ref.sha256 for name, ref in served.items()},
        )
        return self.model_copy(
            update={
                "release_id": release_id,
                "parent_release_id": self.release_id,
                "harness_version": harness_version,
                "hcp_version": hcp_version,
                "router_version": router,
                "adapters": served,
            }
        )


@dataclass(frozen=True)
class ServedRelease:
    """A release with the harness it names, loaded: what a turn is answered with. Refuses a
    harness the release does not name (``HarnessInvalid``)."""

    release: Release
    harness: HarnessVersion

    def __post_init__(self) -> None:
        if harness_number(self.release.harness_version) != self.harness.version:
            raise HarnessInvalid(
                f"release {self.release.release_id} names {self.release.harness_version}, "
                f"not {self.harness.name}"
            )


def release_id_for(
    parent_release_id: str | None,
    base_model: str,
    router_version: str,
    harness_version: str,
    hcp_version: str,
    adapter_shas: dict[str, str],
) -> str:
    """A release id that is a digest of what the release is: the same pair, the same id."""
    content = {
        "parent": parent_release_id,
        "base_model": base_model,
        "router": router_version,
        "harness": harness_version,
        "hcp": hcp_version,
        "adapters": adapter_shas,
    }
    return "rel-" + sha256_hex(canonical_json(content))[:16]


def rebased(candidate: Release, judged_against: Release, active: Release) -> Release | None:
    """``candidate``, judged against its parent ``judged_against``, as a child of ``active``
    (a release promoted since), when the two changes are independent: one side swaps only the
    router and the other leaves the router alone and serves the same specialists. A router is
    judged on the routing suite's text alone, and the task suites serve each task by its named
    specialist, so neither verdict depends on the other side's change. ``None`` when they are
    not independent: the candidate must be judged again."""
    ours, theirs = _changes(judged_against, candidate), _changes(judged_against, active)
    same_specialists = candidate.adapters.keys() == active.adapters.keys()
    if ours == {"router"} and "router" not in theirs and same_specialists:
        kept, router = active, candidate.router_version
    elif theirs == {"router"} and "router" not in ours and same_specialists:
        kept, router = candidate, active.router_version
    else:
        return None
    release_id = release_id_for(
        active.release_id,
        kept.base_model,
        router,
        kept.harness_version,
        kept.hcp_version,
        {name: ref.sha256 for name, ref in kept.adapters.items()},
    )
    return kept.model_copy(
        update={
            "release_id": release_id,
            "parent_release_id": active.release_id,
            "router_version": router,
        }
    )


def changed_specialists(
    parent: tuple[Release, HarnessVersion], candidate: tuple[Release, HarnessVersion]
) -> frozenset[str] | None:
    """The specialists whose answers ``candidate`` can change against ``parent``: those whose
    adapter or harness entry (prompt, exemplars, output, grammar, decoding) differs. A contract
    task is served by the specialist it names alone, so the others answer as before. ``None``
    when the change reaches every specialist: another base model, set of specialists, HCP
    version, GenUI catalogue or tool set."""
    (old, old_harness), (new, new_harness) = parent, candidate
    before, after = old_harness.spec, new_harness.spec
    shared = (before.hcp_version, before.catalogue_version, before.tools)
    if (
        old.base_model != new.base_model
        or old.adapters.keys() != new.adapters.keys()
        or before.specialists.keys() != after.specialists.keys()
        or shared != (after.hcp_version, after.catalogue_version, after.tools)
    ):
        return None
    return frozenset(
        name
        for name in after.specialists.keys() | new.adapters.keys()
        if old.adapters.get(name) != new.adapters.get(name)
        or before.specialists.get(name) != after.specialists.get(name)
    )


def _changes(before: Release, after: Release) -> set[str]:
    """Which parts of ``before`` ``after`` changed: router, adapters, harness, base model."""
    parts = {
        "router": (before.router_version, after.router_version),
        "adapters": (before.adapters, after.adapters),
        "harness": (
            (before.harness_version, before.hcp_version),
            (after.harness_version, after.hcp_version),
        ),
        "base model": (before.base_model, after.base_model),
    }
    return {part for part, (old, new) in parts.items() if old != new}
