"""What a snapshot's records train: ``learners.training.train.training_examples``, without a
database."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from core.events import ChatMessage, ExperienceRecorded
from learners.recipes.config import LiveSample
from learners.training.train import training_examples

MESSAGES: Any = [{"role": "user", "content": "What is 2+2?"}]
CHAT = [ChatMessage(role="user", content="What is 2+2?")]
CALL = {"name": "calculator", "args": {"expression": "2+2"}, "result": "4", "ok": True}


def record(n: int, kind: str, adapter: str = "agent@1", **body: Any) -> ExperienceRecorded:
    """Record of turn ``n``."""
    return ExperienceRecorded(
        experience_id=UUID(int=len(body) * 1000 + n + int(body.get("reward", 0) * 100)),
        kind=kind,  # type: ignore[arg-type]
        specialist="agent",
        turn_id=UUID(int=100 + n),
        filter_version="experience-1",
        source="feedback",
        record={"messages": MESSAGES, "adapter_version": adapter, "release_id": "r", **body},
    )


def test_live_rewards_of_the_parents_answers_train_each_turns_first_step_once() -> None:
    """The parent's answers, each turn's latest reward only, its first step as the answer."""
    records = [
        record(1, "sft", target="4"),
        record(2, "trajectory", actions=[CALL], answer="It is 4.", reward=1.0),
        record(3, "trajectory", actions=[], answer="Five.", reward=1.0),  # its tree was valid
        record(4, "trajectory", "agent@0", actions=[], answer="Six.", reward=0.0),  # older policy
        record(3, "trajectory", actions=[], answer="Five.", reward=0.0),  # then a thumbs down
    ]
    found = training_examples(records, [], "agent@1")
    assert [e.target for e in found.sft] == ["4"]
    assert found.live == [
        LiveSample(
            messages=CHAT,
            answer='{"tool": "calculator", "args": {"expression": "2+2"}}',
            reward=1.0,
        ),
        LiveSample(messages=CHAT, answer="Five.", reward=0.0),
    ]
    assert found.pairs == [] and found.groups == [] and found.older == []


def test_a_preference_record_is_a_pair_with_chosen_and_rejected_in_order() -> None:
    """The better answer stays ``chosen`` on its way from the record to the loss (a swap
    would train the model toward the worse one and no other test would notice)."""
    records = [
        record(1, "preference", chosen="It is 4.", rejected="It is 5."),
        record(2, "preference", chosen="Four.", rejected="I cannot say."),
    ]
    pairs = training_examples(records, [], "agent@1").pairs
    assert [(p.chosen, p.rejected) for p in pairs] == [
        ("It is 4.", "It is 5."),
        ("Four.", "I cannot say."),
    ]
    assert all(p.messages == CHAT for p in pairs)
