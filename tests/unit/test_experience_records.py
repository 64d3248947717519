"""The typed experience records store exactly the JSON the rules wrote before they were typed:
the same keys in the same order, optional fields only where given (so snapshot hashes and
replays are unchanged)."""

from __future__ import annotations

from typing import Any

import pytest

from core.canonical import canonical_json
from core.experience import (
    ExperienceRecord,
    GroupRecord,
    PreferenceRecord,
    SFTRecord,
    TrajectoryRecord,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
SERVED = {"adapter_version": "agent@1", "release_id": "r1"}
CALL = {"name": "calculator", "args": {"expression": "2+2"}, "result": "4", "ok": True}

STORED: list[tuple[type[ExperienceRecord], dict[str, Any]]] = [
    (SFTRecord, {"messages": MESSAGES, "target": "4", **SERVED}),
    (SFTRecord, {"messages": MESSAGES, "target": "4", "rollout_id": "r-1", **SERVED}),
    (PreferenceRecord, {"messages": MESSAGES, "chosen": "4", "rejected": "5", **SERVED}),
    (
        PreferenceRecord,
        {
            "messages": MESSAGES,
            "chosen": "4",
            "rejected": "5",
            "chosen_rollout_id": "r-1",
            "rejected_rollout_id": "r-2",
            **SERVED,
        },
    ),
    (
        TrajectoryRecord,
        {"messages": MESSAGES, "actions": [CALL], "answer": None, "reward": 0.5, **SERVED},
    ),
    (
        GroupRecord,
        {
            "messages": MESSAGES,
            "samples": [
                {"answer": "4", "reward": 1.0, "rollout_id": "r-1"},
                {"answer": "5", "reward": 0.0, "rollout_id": "r-2"},
            ],
            "adapter_version": "agent@1",
            "release_id": None,
        },
    ),
]


@pytest.mark.parametrize(("kind", "stored"), STORED)
def test_a_record_stores_what_it_was_made_from(
    kind: type[ExperienceRecord], stored: dict[str, Any]
) -> None:
    record = kind.model_validate(stored)
    assert record.stored() == stored
    assert list(record.stored()) == list(stored)
    assert canonical_json(record.stored()) == canonical_json(stored)
