"""Rebasing a judged candidate onto a release promoted since: only a router change and a change
that leaves the router alone are independent."""

from __future__ import annotations

from core.harness.artifact import HarnessVersion, root_harness
from core.release import AdapterRef, Release, rebased
from tests.factories import root_release


def _coding(root: Release, version: int) -> dict[str, AdapterRef]:
    ref = root.adapters["coding"].model_copy(update={"version": version, "sha256": "1" * 64})
    return {"coding": ref}


def test_an_adapter_candidate_rebased_onto_a_router_release_keeps_both_changes() -> None:
    root = root_release("chat", "coding")
    router_release = root.successor(router_version="router-2")
    candidate = root.successor(adapters=_coding(root, 1))
    child = rebased(candidate, root, router_release)
    assert child is not None
    assert child.parent_release_id == router_release.release_id
    assert (child.router_version, child.adapters) == ("router-2", candidate.adapters)
    assert child == router_release.successor(adapters=_coding(root, 1))


def test_a_router_candidate_rebased_onto_a_harness_release_keeps_both_changes() -> None:
    root = root_release("chat", "coding")
    spec = root_harness()
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    harness_release = root.successor(harness=harness)
    candidate = root.successor(router_version="router-2")
    child = rebased(candidate, root, harness_release)
    assert child == harness_release.successor(router_version="router-2")


def test_changes_that_touch_the_same_part_or_the_specialists_are_not_rebased() -> None:
    root = root_release("chat", "coding")
    adapters = root.successor(adapters=_coding(root, 1))
    other_adapters = root.successor(adapters=_coding(root, 2))
    router = root.successor(router_version="router-2")
    other_router = root.successor(router_version="router-3")
    added = root.adapters["coding"].model_copy(update={"specialist": "legal"})
    with_specialist = root.successor(adapters={"legal": added}, router_version="router-4")
    assert rebased(adapters, root, other_adapters) is None
    assert rebased(router, root, other_router) is None
    assert rebased(router, root, with_specialist) is None
    assert rebased(with_specialist, root, router) is None
