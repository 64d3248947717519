"""The one contract every ``RunRegistry`` passes, unchanged: PostgreSQL and in memory.

Subclasses provide the ``registry`` fixture: a fresh, empty registry that knows the specialists
``coding`` and ``agent``."""

from __future__ import annotations

import hashlib
import time
import uuid

from core.registry import DatasetSnapshot, NewAdapterVersion, QueuedRun, RunOutput
from core.run_registry import Candidate, RunRegistry


def root(registry: RunRegistry, specialist: str = "coding") -> int:
    """Register ``specialist@0``; its id."""
    ref = registry.register_adapter(
        NewAdapterVersion(
            specialist=specialist,
            version=0,
            parent_id=None,
            sha256=hashlib.sha256(specialist.encode()).hexdigest(),
            path=f"adapters/{specialist}/0",
            rank=8,
            base_model="smollm2",
        )
    )
    return ref.adapter_version_id


def snapshot(registry: RunRegistry, specialist: str = "coding") -> DatasetSnapshot:
    made = DatasetSnapshot(
        snapshot_id=uuid.uuid4(),
        specialist=specialist,
        partition=0,
        start_offset=3,
        end_offset=17,
        filter_version="v3",
        content_hash="ab" * 32,
        record_count=9,
        backfills=(uuid.uuid4(),),
        left_out_tenants=("acme",),
    )
    registry.record_snapshot(made)
    return made


def queued(registry: RunRegistry, specialist: str = "coding") -> QueuedRun:
    run = QueuedRun(
        run_id=uuid.uuid4(),
        specialist=specialist,
        parent_adapter_id=root(registry, specialist),
        snapshot_id=snapshot(registry, specialist).snapshot_id,
        kind="adapter",
        recipe="sft",
    )
    assert registry.queue(run)
    return run


def candidate(parent_id: int, specialist: str = "coding") -> Candidate:
    return Candidate(
        specialist=specialist,
        parent_id=parent_id,
        sha256="cd" * 32,
        path=f"adapters/{specialist}/next",
        rank=8,
        base_model="smollm2",
    )


OUTPUT = RunOutput(config={"lr": 0.1}, metrics={"final_loss": 0.5}, recipe="rloo")


class RunRegistryContract:
    def test_an_adapter_reads_back_as_registered(self, registry: RunRegistry) -> None:
        parent = root(registry)
        found = registry.adapter(parent)
        assert found is not None
        assert (found.ref.name, found.ref.rank, found.parent_id, found.base_model) == (
            "coding@0",
            8,
            None,
            "smollm2",
        )
        assert registry.adapter(parent + 1000) is None

    def test_a_snapshot_reads_back_as_recorded_and_is_recorded_once(
        self, registry: RunRegistry
    ) -> None:
        made = snapshot(registry)
        registry.record_snapshot(made)  # again: nothing changes
        assert registry.snapshot(made.snapshot_id) == made
        assert registry.snapshot(uuid.uuid4()) is None

    def test_one_run_per_specialist_is_in_flight(self, registry: RunRegistry) -> None:
        run = queued(registry)
        assert not registry.queue(run)  # the same run again
        other = QueuedRun(
            run_id=uuid.uuid4(),
            specialist="coding",
            parent_adapter_id=run.parent_adapter_id,
            snapshot_id=run.snapshot_id,
            kind="harness",
            recipe="harness.grammar",
        )
        assert not registry.queue(other)  # coding has a run queued
        queued(registry, "agent")  # another specialist's run is queued
        found = registry.run(run.run_id)
        assert found is not None
        assert (found.status, found.kind, found.recipe, found.unlearning) == (
            "queued",
            "adapter",
            "sft",
            False,
        )

    def test_a_claimed_run_is_held_until_its_lease_runs_out(self, registry: RunRegistry) -> None:
        run = queued(registry)
        claimed = registry.claim(run.run_id, 600)
        assert claimed is not None and claimed.status == "running"
        assert claimed.snapshot_id == run.snapshot_id
        assert registry.claim(run.run_id, 600) is None  # a live worker holds it
        registry.renew_lease(run.run_id, 0)
        time.sleep(0.01)
        again = registry.claim(run.run_id, 600)  # its worker died: the lease ran out
        assert again is not None and again.status == "running"
        assert registry.claim(uuid.uuid4(), 600) is None

    def test_a_candidate_is_the_next_version_and_the_run_succeeds_with_it(
        self, registry: RunRegistry
    ) -> None:
        run = queued(registry)
        before = registry.result(run.run_id)
        assert before is not None and (before.status, before.version) == ("queued", None)
        assert registry.claim(run.run_id, 600) is not None
        made = registry.record_candidate(run.run_id, candidate(run.parent_adapter_id), OUTPUT)
        assert made.name == "coding@1"
        done = registry.result(run.run_id)
        assert done is not None
        assert (done.status, done.specialist, done.version) == ("succeeded", "coding", 1)
        finished = registry.run(run.run_id)
        assert finished is not None and finished.result_adapter_id == made.adapter_version_id
        assert (finished.recipe, dict(finished.metrics)) == ("rloo", {"final_loss": 0.5})
        assert registry.claim(run.run_id, 600) is None  # done
        stored = registry.adapter(made.adapter_version_id)
        assert stored is not None and stored.parent_id == run.parent_adapter_id
        follow = QueuedRun(
            run_id=uuid.uuid4(),
            specialist="coding",
            parent_adapter_id=made.adapter_version_id,
            snapshot_id=run.snapshot_id,
            kind="adapter",
            recipe="sft",
        )
        assert registry.queue(follow)  # nothing of coding is in flight any more
        assert registry.claim(follow.run_id, 600) is not None
        again = registry.record_candidate(follow.run_id, candidate(made.adapter_version_id), OUTPUT)
        assert again.name == "coding@2"

    def test_a_failed_run_keeps_its_error(self, registry: RunRegistry) -> None:
        run = queued(registry)
        assert registry.claim(run.run_id, 600) is not None
        registry.fail(run.run_id, "RuntimeError('out of memory')")
        failed = registry.run(run.run_id)
        assert failed is not None
        assert (failed.status, failed.error) == ("failed", "RuntimeError('out of memory')")
        result = registry.result(run.run_id)
        assert result is not None and (result.status, result.version) == ("failed", None)
        assert registry.claim(run.run_id, 600) is None
        assert registry.result(uuid.uuid4()) is None and registry.run(uuid.uuid4()) is None
