"""Rollouts without servers: the experience rules of a scored group, the verifier's verdicts,
the rollout events' validation and decoding, and the environments the bank gives."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from core.canonical import canonical_json, sha256_hex
from core.contract import Task
from core.errors import ConfigError, InvalidEvent
from core.events import (
    ChatMessage,
    Envelope,
    ExperienceRecorded,
    NewEvent,
    RolloutScored,
    RolloutStep,
    decode_payload,
)
from core.experience import EMPTY_CHAIN, FILTER_VERSION, chain_record
from core.log import LogPosition, RecordedEvent
from infra.postgres.rollout_joins import ScoredSample
from learners.contract_runner import DEFAULT_CONTRACT, load_contract
from learners.environments import CheckerVerifier, judge, load_environments
from learners.tasks import BANK_V1, load_bank
from streams.rollout_records import group_records
from tests.factories import raw_envelope

GROUP = uuid.UUID("0190f0a0-0000-7000-8000-00000000a001")
SCORED = uuid.UUID("0190f0a0-0000-7000-8000-00000000a0ff")
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
MESSAGES = (
    ChatMessage(role="system", content="Be a designer."),
    ChatMessage(role="user", content="Title it."),
)
TASK = Task(
    id="t-1",
    specialist="genui",
    prompt="Title it.",
    checker={"kind": "regex", "pattern": "^H"},  # type: ignore[arg-type]
    reference="Heading",
)


def sample(
    n: int, answer: str, passed: bool, failure: str | None = None, *, hinted: bool = False
) -> ScoredSample:
    return ScoredSample(
        rollout_id=uuid.UUID(int=n + 1),
        group_id=GROUP,
        sample=n,
        tenant_id="system",
        specialist="genui",
        release_id="rel-1",
        adapter_version="genui@1",
        messages=MESSAGES,
        answer=answer,
        hinted=hinted,
        reward=None if failure else float(passed),
        passed=passed,
        failure=failure,
    )


def scored_event() -> RecordedEvent:
    payload = RolloutScored(
        rollout_id=uuid.UUID(int=4),
        group_id=GROUP,
        verifier="checker",
        verifier_version="verifier-1",
        reward=1.0,
        passed=True,
    )
    sealed = NewEvent(
        payload=payload, tenant_id="system", key="rollouts.x", event_id=SCORED, occurred_at=AT
    ).seal(8, None)
    return RecordedEvent(LogPosition(0, 7), sealed.envelope, sealed.payload)


def records(group: list[ScoredSample]) -> list[ExperienceRecorded]:
    found = [e.payload for e in group_records(group, scored_event(), FILTER_VERSION)]
    assert all(isinstance(p, ExperienceRecorded) for p in found)
    return found  # type: ignore[return-value]


# --- what a scored group teaches --------------------------------------------------------------


def test_passed_samples_are_sft_examples_and_pair_with_failed_ones() -> None:
    group = [
        sample(0, "Hello", True),
        sample(1, "nope", False),
        sample(2, "Hi there", True),
        sample(3, "crash", False, failure="verifier_error: boom"),
    ]
    found = records(group)
    assert [r.kind for r in found] == ["sft", "sft", "preference", "group"]
    assert [r.record["target"] for r in found[:2]] == ["Hello", "Hi there"]
    assert found[0].record["rollout_id"] == str(uuid.UUID(int=1))
    pair = found[2].record
    assert (pair["chosen"], pair["rejected"]) == ("Hello", "nope")
    assert (pair["chosen_rollout_id"], pair["rejected_rollout_id"]) == (
        str(uuid.UUID(int=1)),
        str(uuid.UUID(int=2)),
    )
    assert found[3].record["samples"] == [
        {"answer": s.answer, "reward": s.reward, "rollout_id": str(s.rollout_id)} for s in group[:3]
    ]
    for record in found:
        assert record.turn_id is None and record.rollout_group_id == GROUP
        assert record.record["messages"] == [m.model_dump() for m in MESSAGES]
        assert record.record["release_id"] == "rel-1"
        assert "crash" not in str(record.record)  # a failed verdict teaches nothing
    events = group_records(group, scored_event(), FILTER_VERSION)
    assert all(e.causation_id == SCORED and e.key == "experience.genui" for e in events)
    assert [e.event_id for e in events] == [
        e.event_id for e in group_records(group, scored_event(), FILTER_VERSION)
    ]


def test_a_hinted_group_teaches_its_passes_and_pairs_but_is_no_policy_gradient_group() -> None:
    """Its answers were drawn with the hint in the context, not in the one records teach in."""
    group = [sample(0, "Hello", True, hinted=True), sample(1, "nope", False, hinted=True)]
    assert [r.kind for r in records(group)] == ["sft", "preference"]


def test_a_repeated_answer_is_taught_once_and_a_group_without_a_pass_teaches_nothing() -> None:
    # all rewarded alike: no group record (no advantage to learn from)
    assert [r.kind for r in records([sample(0, "Hi", True), sample(1, "Hi", True)])] == ["sft"]
    assert records([sample(0, "no", False), sample(1, "x", False, failure="timeout")]) == []


# --- verdicts ---------------------------------------------------------------------------------


class Fixed:
    name = "fixed"
    version = "test-1"

    def __init__(self, reward: float) -> None:
        self.value = reward

    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        return self.value


class Crashing(Fixed):
    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        raise ValueError("cannot judge")


STEPS = [RolloutStep(output="Heading")]


def test_verdicts_keep_rewards_in_range_and_turn_crashes_into_failures() -> None:
    assert judge(CheckerVerifier(), TASK, STEPS).passed
    assert not judge(CheckerVerifier(), TASK, [RolloutStep(output="no")]).passed
    partial = judge(Fixed(0.5), TASK, STEPS)
    assert (partial.reward, partial.passed, partial.failure) == (0.5, False, None)
    crashed = judge(Crashing(0), TASK, STEPS)
    assert crashed.reward is None and not crashed.passed
    assert crashed.failure == "verifier_error: ValueError: cannot judge"
    for bad in (1.5, -0.1, float("nan")):
        verdict = judge(Fixed(bad), TASK, STEPS)
        assert verdict.reward is None and str(verdict.failure).startswith("reward_out_of_range")


def test_a_verdict_has_a_reward_in_range_or_a_failure() -> None:
    fields: dict[str, Any] = {
        "rollout_id": uuid.uuid4(),
        "group_id": GROUP,
        "verifier": "v",
        "verifier_version": "1",
    }
    with pytest.raises(ValidationError):
        RolloutScored(**fields, reward=1.5, passed=True)
    with pytest.raises(ValidationError):
        RolloutScored(**fields, reward=None, passed=False)
    with pytest.raises(ValidationError):
        RolloutScored(**fields, reward=None, passed=True, failure="boom")
    stored = Envelope.validate(
        raw_envelope(
            key="rollouts.x",
            type="RolloutScored",
            schema_version=1,
            payload={**{k: str(v) for k, v in fields.items()}, "reward": 2.0, "passed": True},
        )
    )
    with pytest.raises(InvalidEvent):  # the log sets it aside as a dead letter
        decode_payload(stored)


# --- records from turns and from rollouts -----------------------------------------------------


def test_a_record_has_one_source_and_v1_records_hash_as_before() -> None:
    fields: dict[str, Any] = {
        "experience_id": uuid.UUID(int=9),
        "kind": "sft",
        "specialist": "chat",
        "filter_version": "experience-1",
        "record": {"messages": [], "target": "Paris."},
    }
    with pytest.raises(ValidationError):
        ExperienceRecorded(**fields, turn_id=None)
    with pytest.raises(ValidationError):
        ExperienceRecorded(**fields, turn_id=uuid.UUID(int=1), rollout_group_id=GROUP)
    v1 = {**fields, "experience_id": str(fields["experience_id"]), "turn_id": str(uuid.UUID(int=1))}
    stored = Envelope.validate(
        raw_envelope(key="experience.chat", type="ExperienceRecorded", schema_version=1, payload=v1)
    )
    decoded = decode_payload(stored)
    assert isinstance(decoded, ExperienceRecorded) and decoded.rollout_group_id is None
    # A snapshot defined over v1 records still replays to its hash.
    v1_hash = sha256_hex(canonical_json(v1))
    assert chain_record(EMPTY_CHAIN, decoded) == sha256_hex(f"{EMPTY_CHAIN}{v1_hash}".encode())


# --- environments -----------------------------------------------------------------------------


def test_no_contract_task_is_an_environment_and_no_hint_is_a_reference() -> None:
    contract = load_contract(DEFAULT_CONTRACT)
    environments = load_environments(contract)
    assert len(environments) == len(load_bank())
    held_out = [task for tasks in contract.suites.values() for task in tasks]
    prompts = {env.task.prompt for env in environments.values()}
    assert not {task.id for task in held_out} & environments.keys()
    assert not {task.prompt for task in held_out} & prompts
    for env in environments.values():
        assert env.hint is None or env.task.reference not in env.hint
    assert {env.hint is not None for env in environments.values()} == {True, False}


def test_a_bank_holding_a_contract_task_gives_no_environments(tmp_path: Path) -> None:
    contract = load_contract(DEFAULT_CONTRACT)
    bank = yaml.safe_load(BANK_V1.read_text())
    held_out = contract.suites["genui"][0]
    bank["tasks"].append(held_out.model_dump(mode="json"))
    path = tmp_path / "bank.yaml"
    path.write_text(yaml.safe_dump(bank))
    with pytest.raises(
        ConfigError, match=f"contract task '{held_out.id}'.*cannot be an environment"
    ):
        load_environments(contract, path)
