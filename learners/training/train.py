"""Train an adapter successor: the run's parent adapter trained on its dataset snapshot (and
older records of the specialist, against forgetting), stored, registered as the specialist's
next version, and announced with ``CandidateTrained``."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from core.events import CandidateTrained, NewEvent
from core.experience import (
    GroupRecord,
    PreferenceRecord,
    SFTRecord,
    TrajectoryRecord,
    first_step,
    records_of,
    source_of,
)
from core.registry import (
    AdapterVersion,
    DatasetSnapshot,
    RunOutput,
    TrainingRun,
)
from core.release import AdapterRef
from core.run_registry import Candidate
from learners.recipes.config import (
    DEFAULT_CONFIG,
    Examples,
    LiveSample,
    PreferencePair,
    RolloutGroup,
    SFTExample,
    TrainingConfig,
)
from learners.recipes.lora import train_successor_adapter
from learners.runtime import Progress, Runtime, step_id
from learners.training.snapshots import materialize


def train_adapter(
    rt: Runtime,
    run: TrainingRun,
    snapshot: DatasetSnapshot,
    parent: AdapterVersion,
    progress: Progress | None,
) -> str:
    """Train, register and announce the run's successor adapter; returns its versioned name."""
    replayed = materialize(rt.log, snapshot)
    records, older = (
        of_sources(replayed.records, rt.training),
        of_sources(replayed.older, rt.training),
    )
    examples = training_examples(records, older, parent.ref.name)
    parent_dir = rt.store.verified_path(parent.ref.sha256, parent.ref.path)
    with tempfile.TemporaryDirectory() as scratch:
        result = train_successor_adapter(
            rt.model_dir, parent_dir, Path(scratch), examples, rt.training, progress
        )
        sha, stored = rt.store.put(Path(scratch))
    metrics = {
        "final_loss": result.final_loss,
        "seconds": result.seconds,
        "examples": float(result.examples),
        "pairs": float(result.pairs),
        "samples": float(result.samples),
        "bfloat16": float(result.precision == "bfloat16"),  # 1: computed in bf16 (``precision``)
        "tenants": float(replayed.tenants),
        "left_out": float(len(replayed.records) - len(records)),
    }
    adapter = _record_candidate(rt, run, parent, sha, str(stored), metrics)
    rt.log.append(
        [
            NewEvent(
                payload=CandidateTrained(
                    run_id=run.run_id,
                    specialist=run.specialist,
                    adapter_version=adapter.name,
                    parent_adapter_version=parent.ref.name,
                    sha256=sha,
                    metrics=metrics,
                ),
                tenant_id="system",
                key=f"training.{run.specialist}",
                event_id=step_id(run.run_id, "trained"),
            )
        ]
    )
    return adapter.name


def of_sources(records: list[Any], config: TrainingConfig) -> list[Any]:
    """The records whose source the config trains on (``TrainingConfig.sources``); the
    snapshot still hashes every record of its range, so what was left out stays auditable."""
    return [r for r in records if source_of(r) in config.sources]


def training_examples(records: list[Any], older: list[Any], parent: str) -> Examples:
    """The snapshot's SFT examples, preference pairs, and the rollout groups and live rewards
    of answers ``parent`` gave (a policy gradient's ratio and KL are taken to the policy that
    drew the answers; a live reward trains the turn's first step), and the older SFT
    examples."""
    return Examples(
        sft=[
            SFTExample(messages=r.messages, target=r.target) for r in records_of(SFTRecord, records)
        ],
        pairs=[
            PreferencePair(messages=r.messages, chosen=r.chosen, rejected=r.rejected)
            for r in records_of(PreferenceRecord, records)
        ],
        groups=[
            RolloutGroup(
                messages=r.messages,
                answers=[s.answer for s in r.samples],
                rewards=[s.reward for s in r.samples],
            )
            for r in records_of(GroupRecord, records)
            if r.adapter_version == parent
        ],
        live=[
            LiveSample(messages=r.messages, answer=first_step(r.actions, r.answer), reward=r.reward)
            for r in records_of(TrajectoryRecord, _latest_per_turn(records))
            if r.adapter_version == parent
        ],
        older=[
            SFTExample(messages=r.messages, target=r.target) for r in records_of(SFTRecord, older)
        ],
    )


def _latest_per_turn(records: list[Any]) -> list[Any]:
    """The live rewards, one per turn: the latest (a user's thumbs-down after a valid GenUI
    tree says more than the validity did)."""
    latest = {r.turn_id: r for r in records if r.kind == "trajectory"}
    return list(latest.values())


def _record_candidate(
    rt: Runtime,
    run: TrainingRun,
    parent: AdapterVersion,
    sha: str,
    path: str,
    metrics: dict[str, float],
) -> AdapterRef:
    """Register the trained adapter as the specialist's next version and finish the run."""
    return rt.runs.record_candidate(
        run.run_id,
        Candidate(
            specialist=run.specialist,
            parent_id=parent.ref.adapter_version_id,
            sha256=sha,
            path=path,
            rank=parent.ref.rank,
            base_model=parent.base_model,
        ),
        RunOutput(
            config=rt.training.model_dump(),
            metrics=metrics,
            recipe=(rt.settings.training_config or DEFAULT_CONFIG).stem,
        ),
    )
