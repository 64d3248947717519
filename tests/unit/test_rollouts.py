"""Rollouts without servers: the experience rules of a scored group, the verifier's verdicts,
the rollout events' validation and decoding, and the environments the bank gives."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from core.canonical import canonical_json, sha256_hex
from core.errors import InvalidEvent, TaskBankInvalid
from core.events import (
    ChatMessage,
    Envelope,
    ExperienceRecorded,
    ExperienceSource,
    NewEvent,
    RolloutScored,
    RolloutStep,
    decode_payload,
)
from core.experience import EMPTY_CHAIN, FILTER_VERSION, chain_record, source_of
from core.log import LogPosition, RecordedEvent
from core.mapper import Mapper
from core.tasks import GenUIChecker, Task, ToolCallChecker
from infra.postgres.rollout_joins import ScoredSample
from learners.evaluation.checkers import check
from learners.evaluation.contract_runner import (
    CONTRACT_V1,
    DEFAULT_CONTRACT,
    load_contract,
    load_training_bank,
)
from learners.rollouts.environments import CheckerVerifier, judge, load_environments
from learners.rollouts.job import RolloutJob, flat
from learners.tasks import BANK_V1, BANK_V2, DEFAULT_BANK, load_bank
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
    event = NewEvent(
        payload=payload, tenant_id="system", key="rollouts.x", event_id=SCORED, occurred_at=AT
    )
    sealed = Mapper().seal(event, 8, None)
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


def test_a_genui_tree_is_rewarded_the_share_of_what_was_asked_that_it_shows() -> None:
    """A valid tree and each word and value asked count alike; it passes (1.0) only when the
    contract's checker does, and a tree that does not parse earns nothing."""
    task = Task(
        id="t-genui",
        specialist="genui",
        prompt="Show Acme's revenue of 1,250.",
        checker=GenUIChecker(kind="genui", must_contain=["Acme", "revenue"], values=[1250]),
        reference='{"type": "Text", "text": "Acme revenue 1,250"}',
    )

    def scored(output: str) -> tuple[float | None, bool]:
        verdict = judge(CheckerVerifier(), task, [RolloutStep(output=output)])
        return verdict.reward, verdict.passed

    assert scored('{"type": "Text", "text": "acme REVENUE: 1,250"}') == (1.0, True)
    assert scored('{"type": "Text", "text": "Acme revenue"}') == (0.75, False)
    assert scored('{"type": "Text", "text": "Acme"}') == (0.5, False)
    assert scored('{"type": "Text", "text": "nothing asked"}') == (0.25, False)
    assert scored('{"type": "Text", "text": ') == (0.0, False)  # no tree
    assert scored("Acme revenue 1,250") == (0.0, False)  # the words, but no tree
    for output in ('{"type": "Text", "text": "Acme revenue 1250"}', "Acme"):
        assert scored(output)[1] == check(task, output)  # the contract's verdict


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
        ExperienceRecorded(**fields, turn_id=None, source="rollout")
    with pytest.raises(ValidationError):
        ExperienceRecorded(
            **fields, turn_id=uuid.UUID(int=1), rollout_group_id=GROUP, source="rollout"
        )
    v1 = {**fields, "experience_id": str(fields["experience_id"]), "turn_id": str(uuid.UUID(int=1))}
    stored = Envelope.validate(
        raw_envelope(key="experience.chat", type="ExperienceRecorded", schema_version=1, payload=v1)
    )
    decoded = decode_payload(stored)
    assert isinstance(decoded, ExperienceRecorded) and decoded.rollout_group_id is None
    # A snapshot defined over v1 records still replays to its hash.
    v1_hash = sha256_hex(canonical_json(v1))
    assert chain_record(EMPTY_CHAIN, decoded) == sha256_hex(f"{EMPTY_CHAIN}{v1_hash}".encode())


def test_a_record_says_its_source_and_v2_records_hash_as_before() -> None:
    """v3 records carry their source, one that fits their origin; v2 records read back with
    none, hash as they were written, and tell their source where their origin does."""
    turn: dict[str, Any] = {"turn_id": uuid.UUID(int=1), "rollout_group_id": None}
    group: dict[str, Any] = {"turn_id": None, "rollout_group_id": GROUP}
    fields: dict[str, Any] = {
        "experience_id": uuid.UUID(int=9),
        "kind": "sft",
        "specialist": "chat",
        "filter_version": "experience-2",
        "record": {"messages": [], "target": "Paris."},
    }
    mismatched: list[tuple[dict[str, Any], ExperienceSource]] = [
        (turn, "rollout"),
        (group, "edit"),
        (group, "feedback"),
    ]
    for origin, source in mismatched:
        with pytest.raises(ValidationError, match="record comes from"):
            ExperienceRecorded(**fields, **origin, source=source)
    assert source_of(ExperienceRecorded(**fields, **turn, source="edit")) == "edit"
    for origin, kind, told in (
        (turn, "sft", None),  # a thumbs-up's or an edit's: not known
        (turn, "trajectory", "feedback"),
        (group, "sft", "rollout"),
    ):
        v2 = {**fields, **origin, "kind": kind}
        v2 = json.loads(json.dumps(v2, default=str))
        stored = Envelope.validate(
            raw_envelope(
                key="experience.chat", type="ExperienceRecorded", schema_version=2, payload=v2
            )
        )
        decoded = decode_payload(stored)
        assert isinstance(decoded, ExperienceRecorded) and decoded.source is None
        assert source_of(decoded) == told
        if origin is turn:
            del v2["rollout_group_id"]
        v2_hash = sha256_hex(canonical_json(v2))
        assert chain_record(EMPTY_CHAIN, decoded) == sha256_hex(f"{EMPTY_CHAIN}{v2_hash}".encode())


# --- environments -----------------------------------------------------------------------------


def test_no_contract_task_is_an_environment() -> None:
    contract = load_contract(DEFAULT_CONTRACT)
    environments = load_environments(contract)
    assert len(environments) == len(load_bank())
    held_out = [task for tasks in contract.suites.values() for task in tasks]
    prompts = {env.task.prompt for env in environments.values()}
    assert not {task.id for task in held_out} & environments.keys()
    assert not {task.prompt for task in held_out} & prompts


def expected_values(task: Task) -> list[str]:
    """What a task's checker expects that a verifier-only system would not know: the tool's
    name, the argument values, the words and values the tree must show."""
    checker = task.checker
    if isinstance(checker, ToolCallChecker):
        words = [checker.tool, *(str(v) for v in checker.args.values())]
        words += [w for ws in checker.contains.values() for w in ws]
        return words + [str(v) for v in checker.result.values()]
    if isinstance(checker, GenUIChecker):
        return [*checker.must_contain, *(f"{v:g}" for v in checker.values)]
    return []


def leaked(task: Task, hint: str | None) -> list[str]:
    """The expected values in ``hint`` that the prompt does not already say."""
    if hint is None:
        return []
    said = task.prompt.casefold()
    return [
        word
        for word in expected_values(task)
        if re.search(rf"(?<!\w){re.escape(word.casefold())}(?!\w)", hint.casefold())
        and word.casefold() not in said
    ]


def test_the_default_hint_tells_nothing_the_checker_expects() -> None:
    """For every bank task (v1's and v2's), the default hint holds no expected tool name,
    argument value or word the prompt does not already say; the checker hints of the ablation
    do, for over a third of the agent tasks, so this test can fail."""
    contract = load_contract(DEFAULT_CONTRACT)
    for bank in (BANK_V1, DEFAULT_BANK):
        environments = load_environments(contract, bank).values()
        by_default = {env.id: leaked(env.task, env.hint("none")) for env in environments}
        assert not {env: words for env, words in by_default.items() if words}
        agent = [env for env in environments if env.task.specialist == "agent"]
        told = [env for env in agent if leaked(env.task, env.hint("checker"))]
        assert len(told) > len(agent) / 3


def test_a_bank_holding_a_task_of_any_contract_version_is_refused(tmp_path: Path) -> None:
    """Held out from every version, not only the one in use, in oracle mode as in self mode."""
    bank = yaml.safe_load(BANK_V2.read_text())
    held_out = load_contract(CONTRACT_V1).suites["genui"][0]
    bank["tasks"].append(held_out.model_dump(mode="json"))
    path = tmp_path / "bank.yaml"
    path.write_text(yaml.safe_dump(bank))
    with pytest.raises(TaskBankInvalid, match=f"contract task '{held_out.id}'"):
        load_environments(load_contract(DEFAULT_CONTRACT), path)
    with pytest.raises(TaskBankInvalid, match=f"contract task '{held_out.id}'"):
        load_training_bank(path)


def scored(*verdicts: tuple[float | None, bool]) -> list[RolloutScored]:
    group = uuid.uuid4()
    return [
        RolloutScored(
            rollout_id=uuid.uuid4(),
            group_id=group,
            verifier="checker",
            verifier_version="verifier-2",
            reward=reward,
            passed=passed,
            failure=None if reward is not None else "verifier_error: crashed",
        )
        for reward, passed in verdicts
    ]


@pytest.mark.parametrize(
    ("verdicts", "is_flat"),
    [
        (((0.0, False), (0.0, False)), True),  # nothing passed, nothing to tell apart
        (((0.5, False), (0.5, False), (None, False)), True),  # GenUI partial credit, all alike
        (((0.0, False), (0.5, False)), False),  # signal: a policy gradient learns from it
        (((1.0, True), (1.0, True)), False),  # solved: its answer is an SFT example
        (((None, False), (None, False)), False),  # the verifier failed: sampling again fails
    ],
)
def test_a_group_is_flat_when_its_rewards_are_alike_and_none_passed(
    verdicts: tuple[tuple[float | None, bool], ...], is_flat: bool
) -> None:
    assert flat(scored(*verdicts)) is is_flat


def test_a_rollout_budget_holds_whole_groups_of_k() -> None:
    job = {"job_id": uuid.uuid4(), "specialist": "genui", "environments": ["a"], "samples": 4}
    assert RolloutJob.model_validate(job).rounds == 1  # no budget: one group
    assert RolloutJob.model_validate({**job, "budget": 11}).rounds == 2  # whole groups only
    with pytest.raises(ValidationError, match="budget 3 is less than one group of 4"):
        RolloutJob.model_validate({**job, "budget": 3})
