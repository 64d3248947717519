"""Carry out a queued run (the ``train_successor`` task): claim it under a lease, then train an
adapter (``learners.training.train``) or propose a harness (``learners.training.propose``).
Idempotent by run id: a redelivered task finds the run's state and either returns its result or
takes over a run whose lease expired (its worker died)."""

from __future__ import annotations

import time
from uuid import UUID

from core.harness.artifact import harness_name
from learners.runtime import Progress, RunBusy, RunFailed, Runtime
from learners.training.propose import propose_harness
from learners.training.train import train_adapter


def carry_out_run(rt: Runtime, run_id: UUID, progress: Progress | None = None) -> str:
    """Train the run's successor adapter or propose its harness; returns the versioned name
    of what it made (or, for a run that ended already, what is there)."""
    run = rt.runs.claim(run_id, rt.settings.training_lease_seconds)
    if run is None:
        done = rt.runs.result(run_id)
        if done is None:
            raise RunFailed(f"no training run {run_id}")
        if done.status == "running":
            raise RunBusy(f"run {run_id} is being trained by a worker whose lease is live")
        if done.harness_version is not None:
            return harness_name(done.harness_version)
        return f"{done.specialist}@{done.version}" if done.version is not None else done.status
    snapshot = rt.runs.snapshot(run.snapshot_id)
    parent = rt.runs.adapter(run.parent_adapter_id)
    try:
        if snapshot is None or parent is None:
            raise RunFailed(f"run {run_id} lacks its dataset snapshot or its parent adapter")
        if run.kind == "harness":
            return propose_harness(rt, run, snapshot)
        return train_adapter(rt, run, snapshot, parent, _renewing(rt, run_id, progress))
    except Exception as exc:
        rt.runs.fail(run_id, repr(exc)[:2000])
        raise


def _renewing(rt: Runtime, run_id: UUID, progress: Progress | None) -> Progress:
    """Progress that also renews the run's lease while training goes on."""
    renewed = time.monotonic()

    def step(done: int, steps: int, losses: dict[str, float]) -> None:
        nonlocal renewed
        lease = rt.settings.training_lease_seconds
        if time.monotonic() - renewed > lease / 4:
            rt.runs.renew_lease(run_id, lease)
            renewed = time.monotonic()
        if progress is not None:
            progress(done, steps, losses)

    return step
