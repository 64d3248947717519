"""Experience from rollouts (the same in every filter version): what a completely scored
rollout group teaches.

- each distinct answer that passed its verifier: an SFT example (the context without any hint
  the sample saw, and the answer; STaR-style rationalization trains without the hint);
- a passed and a failed answer of the same group, paired in sample order: a preference pair
  (passed chosen, failed rejected);
- the group's verified answers with their rewards, when the rewards differ and the group was
  sampled without help (no hint, no tool forced by a sweep): a ``group`` record for policy
  gradient (RLOO advantages need two answers that scored apart, and a policy gradient needs
  answers drawn in the context it trains in, by its own choices);
- a sample whose verifier failed (crashed, timed out, gave a reward out of range) teaches
  nothing, and neither does a group whose verified answers all scored alike.
No record holds anything but the model's own samples: no reference answer reaches training
from a rollout. Ids derive from the filter version, the group and the record's place in it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from core.events import ExperienceRecorded, NewEvent, RolloutSampled, RolloutScored
from core.experience import (
    ExperienceRecord,
    GroupRecord,
    PreferenceRecord,
    SFTRecord,
    experience_event,
)
from core.ids import derived_id
from core.log import RecordedEvent
from infra.postgres import rollout_joins as store
from infra.postgres.db import DictConnection
from infra.postgres.rollout_joins import ScoredSample

_log = logging.getLogger(__name__)


def record_sampled(conn: DictConnection, event: RecordedEvent, sampled: RolloutSampled) -> None:
    store.record_sample(
        conn,
        {
            "rollout_id": sampled.rollout_id,
            "group_id": sampled.group_id,
            "sample": sampled.sample,
            "group_size": sampled.group_size,
            "tenant_id": event.envelope.tenant_id,
            "specialist": sampled.specialist,
            "release_id": sampled.release_id,
            "adapter_version": sampled.adapter_version,
            "messages": [m.model_dump() for m in sampled.messages],
            "answer": sampled.steps[0].output,
            "hinted": sampled.hint is not None or sampled.first_call is not None,
        },
    )


def record_scored(
    conn: DictConnection, event: RecordedEvent, scored: RolloutScored, version: str
) -> list[NewEvent]:
    """Store the verdict; once the group's last sample is scored, its records under filter
    ``version``."""
    if not store.record_score(
        conn, scored.rollout_id, scored.reward, scored.passed, scored.failure
    ):
        _log.warning("verdict on rollout %s, which was never sampled: ignored", scored.rollout_id)
        return []
    group = store.scored_group(conn, scored.group_id)
    return [] if group is None else group_records(group, event, version)


def group_records(group: list[ScoredSample], event: RecordedEvent, version: str) -> list[NewEvent]:
    """The SFT examples and preference pairs of a completely scored group."""
    verified = [s for s in group if s.failure is None]
    passed = _distinct([s for s in verified if s.passed])
    failed = _distinct([s for s in verified if not s.passed])
    records: list[NewEvent] = []
    for n, sample in enumerate(passed):
        body = {"target": sample.answer, "rollout_id": str(sample.rollout_id)}
        example = SFTRecord.model_validate(_of(sample, body))
        records.append(_record(event, sample, n, example, version))
    for n, (chosen, rejected) in enumerate(zip(passed, failed, strict=False)):
        body = {
            "chosen": chosen.answer,
            "rejected": rejected.answer,
            "chosen_rollout_id": str(chosen.rollout_id),
            "rejected_rollout_id": str(rejected.rollout_id),
        }
        pair = PreferenceRecord.model_validate(_of(chosen, body))
        records.append(_record(event, chosen, n, pair, version))
    rewards = [s.reward for s in verified if s.reward is not None]
    if len(set(rewards)) > 1 and not group[0].hinted:
        samples = [
            {"answer": s.answer, "reward": s.reward, "rollout_id": str(s.rollout_id)}
            for s in verified
        ]
        scored = GroupRecord.model_validate(_of(verified[0], {"samples": samples}))
        records.append(_record(event, verified[0], 0, scored, version))
    return records


def _of(sample: ScoredSample, body: Mapping[str, object]) -> dict[str, object]:
    """A record's fields in their stored order: the sample's context, ``body``, and the
    adapter version and release that sampled it."""
    return {
        "messages": [m.model_dump() for m in sample.messages],
        **body,
        "adapter_version": sample.adapter_version,
        "release_id": sample.release_id,
    }


def _distinct(samples: list[ScoredSample]) -> list[ScoredSample]:
    """The first sample of each answer (K samples often repeat one)."""
    seen: dict[str, ScoredSample] = {}
    for sample in samples:
        seen.setdefault(sample.answer, sample)
    return list(seen.values())


def _record(
    event: RecordedEvent,
    sample: ScoredSample,
    n: int,
    record: ExperienceRecord,
    version: str,
) -> NewEvent:
    """The ``n``-th record of its kind from ``sample``'s group, as an event."""
    payload = ExperienceRecorded(
        experience_id=derived_id(version, sample.group_id, record.kind, n),
        kind=record.kind,
        specialist=sample.specialist,
        turn_id=None,
        rollout_group_id=sample.group_id,
        filter_version=version,
        record=record.stored(),
        source="rollout",
    )
    return experience_event(payload, sample.tenant_id, event.envelope, sample.group_id)
