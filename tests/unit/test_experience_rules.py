"""The experience rules without a database: a joined turn and a completion or feedback event
in, the ``ExperienceRecorded`` events out. ``derive`` applies ``experience-1``; the tests of
``experience-2`` say so."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from typing import Any
from uuid import UUID

import pytest

from core.events import (
    ChatMessage,
    EventPayload,
    ExperienceRecorded,
    FeedbackGiven,
    NewEvent,
    RoutingCorrected,
    RoutingLabelled,
    TurnCompleted,
    TurnReceived,
)
from core.experience import first_step
from core.harness.artifact import root_version
from core.harness.hcp import build_context
from core.log import LogPosition, RecordedEvent
from core.mapper import Mapper
from infra.postgres.experience_joins import JoinedTurn
from streams.experience_rules import context_messages, experience_from
from streams.routing_rules import routing_labels

TURN = UUID("0190f0a0-0000-7000-8000-000000000001")
CONVERSATION = UUID("0190f0a0-0000-7000-8000-0000000000c0")
FEEDBACK = UUID("0190f0a0-0000-7000-8000-0000000000f1")
OTHER_FEEDBACK = UUID("0190f0a0-0000-7000-8000-0000000000f2")
COMPLETED = UUID("0190f0a0-0000-7000-8000-0000000000d0")
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ROOT = root_version()
derive = partial(experience_from, version="experience-1")

CHAT_TURN = JoinedTurn(
    turn_id=TURN,
    conversation_id=CONVERSATION,
    tenant_id="acme",
    specialist="chat",
    adapter_version="chat@2",
    release_id="rel-1",
    content="What is the capital of France?",
    response="Paris.",
    actions=(),
    seed_history=(),
    earlier=(),
)
ACTIONS = (
    {"name": "calculator", "args": {"expression": "2+2"}, "result": 4, "ok": True},
    {"name": "notes", "args": {"op": "get", "key": "x"}, "result": None, "ok": False},
    {"name": "calculator", "args": {"expression": "3*3"}, "result": 9, "ok": True},
)
AGENT_TURN = replace(
    CHAT_TURN,
    specialist="agent",
    adapter_version="agent@1",
    content="What is 2+2 and 3*3?",
    response="4 and 9.",
    actions=ACTIONS,
)


def recorded(payload: EventPayload, event_id: UUID = FEEDBACK, offset: int = 7) -> RecordedEvent:
    event = NewEvent(
        payload=payload, tenant_id="acme", key=str(CONVERSATION), event_id=event_id, occurred_at=AT
    )
    sealed = Mapper().seal(event, offset + 1, None)
    return RecordedEvent(LogPosition(0, offset), sealed.envelope, sealed.payload)


def feedback(kind: str, edited: str | None = None, event_id: UUID = FEEDBACK) -> RecordedEvent:
    return recorded(FeedbackGiven(turn_id=TURN, kind=kind, edited_text=edited), event_id)  # type: ignore[arg-type]


def completed() -> RecordedEvent:
    return recorded(TurnCompleted(turn_id=TURN, latency_ms=12.5, harness=ROOT.stamp), COMPLETED)


def payloads(events: list[NewEvent]) -> list[ExperienceRecorded]:
    found = [e.payload for e in events]
    assert all(isinstance(p, ExperienceRecorded) for p in found)
    return found  # type: ignore[return-value]


# --- feedback -------------------------------------------------------------------------------


def test_thumbs_up_is_an_sft_example_with_the_answer_as_target() -> None:
    [event] = derive(CHAT_TURN, feedback("up"))
    record = payloads([event])[0]
    assert record.kind == "sft"
    assert record.specialist == "chat"
    assert record.turn_id == TURN
    assert record.filter_version == "experience-1"
    assert record.record == {
        "messages": context_messages(CHAT_TURN),
        "target": "Paris.",
        "adapter_version": "chat@2",
        "release_id": "rel-1",
    }


def test_a_record_is_keyed_by_specialist_and_caused_by_the_feedback() -> None:
    [event] = derive(CHAT_TURN, feedback("up"))
    assert event.key == "experience.chat"
    assert event.tenant_id == "acme"
    assert event.causation_id == FEEDBACK
    assert event.correlation_id == TURN
    assert event.occurred_at == AT
    assert event.event_id == event.payload.experience_id  # type: ignore[attr-defined]


def test_the_experience_id_is_pinned() -> None:
    """The derived ids are part of the log: changing them would duplicate every record."""
    [up] = derive(CHAT_TURN, feedback("up"))
    sft, preference = derive(CHAT_TURN, feedback("edit", "Paris, France."))
    assert up.event_id == UUID("d1c91960-5623-534b-8fbb-4155527f5634")
    assert sft.event_id == up.event_id  # same turn, kind and feedback event
    assert preference.event_id == UUID("f968020b-2c2c-50a1-a4db-4b2b91d2dd06")


def test_thumbs_up_on_an_agent_turn_teaches_its_first_tool_call() -> None:
    [event] = derive(AGENT_TURN, feedback("up"))
    target = payloads([event])[0].record["target"]
    assert target == '{"tool": "calculator", "args": {"expression": "2+2"}}'
    assert json.loads(str(target)) == {"tool": "calculator", "args": {"expression": "2+2"}}


def test_first_step_is_the_answer_when_no_tool_was_called() -> None:
    assert first_step(CHAT_TURN.actions, CHAT_TURN.response) == "Paris."
    assert first_step((), AGENT_TURN.response) == "4 and 9."


def test_an_edit_is_an_sft_example_and_a_preference_pair() -> None:
    sft, preference = payloads(derive(CHAT_TURN, feedback("edit", "Paris, France.")))
    messages = context_messages(CHAT_TURN)
    assert sft.kind == "sft"
    assert sft.record["target"] == "Paris, France."
    assert sft.record["messages"] == messages
    assert preference.kind == "preference"
    assert preference.record == {
        "messages": messages,
        "chosen": "Paris, France.",
        "rejected": "Paris.",
        "adapter_version": "chat@2",
        "release_id": "rel-1",
    }
    assert sft.experience_id != preference.experience_id


def test_an_edit_on_an_agent_turn_targets_the_edit_not_the_tool_call() -> None:
    sft, _ = payloads(derive(AGENT_TURN, feedback("edit", "Four and nine.")))
    assert sft.record["target"] == "Four and nine."


@pytest.mark.parametrize("edited", [None, ""])
def test_an_edit_without_text_teaches_nothing(edited: str | None) -> None:
    assert derive(CHAT_TURN, feedback("edit", edited)) == []


@pytest.mark.parametrize("kind", ["down", "regenerate"])
@pytest.mark.parametrize("turn", [CHAT_TURN, AGENT_TURN], ids=["chat", "agent"])
def test_thumbs_down_and_regenerate_reward_the_turn_zero(kind: str, turn: JoinedTurn) -> None:
    """A live reward: the turn as it ran, its actions included, rewarded 0."""
    [event] = derive(turn, feedback(kind))
    [record] = payloads([event])
    assert record.kind == "trajectory" and event.causation_id == FEEDBACK
    assert record.record == {
        "messages": context_messages(turn),
        "actions": [dict(a) for a in turn.actions],
        "answer": turn.response,
        "reward": 0.0,
        "adapter_version": turn.adapter_version,
        "release_id": "rel-1",
    }


@pytest.mark.parametrize("kind", ["down", "regenerate"])
def test_a_negative_on_a_turn_without_an_answer_teaches_nothing(kind: str) -> None:
    assert derive(replace(CHAT_TURN, response=None), feedback(kind)) == []


@pytest.mark.parametrize("kind", ["up", "edit"])
def test_feedback_on_a_turn_without_an_answer_teaches_nothing(kind: str) -> None:
    assert derive(replace(CHAT_TURN, response=None), feedback(kind, "x")) == []


def test_the_same_feedback_gives_the_same_events() -> None:
    first = derive(CHAT_TURN, feedback("edit", "Paris, France."))
    again = derive(CHAT_TURN, feedback("edit", "Paris, France."))
    assert first == again


def test_another_feedback_event_gives_other_ids() -> None:
    [one] = derive(CHAT_TURN, feedback("up"))
    [two] = derive(CHAT_TURN, feedback("up", event_id=OTHER_FEEDBACK))
    assert one.event_id != two.event_id
    assert one.payload.model_dump(exclude={"experience_id"}) == two.payload.model_dump(
        exclude={"experience_id"}
    )


def test_another_turn_gives_other_ids() -> None:
    other = replace(CHAT_TURN, turn_id=UUID("0190f0a0-0000-7000-8000-000000000002"))
    [one] = derive(CHAT_TURN, feedback("up"))
    [two] = derive(other, feedback("up"))
    assert one.event_id != two.event_id


# --- trajectories ---------------------------------------------------------------------------


def test_a_completed_agent_turn_with_actions_is_a_trajectory() -> None:
    [event] = derive(AGENT_TURN, completed())
    [record] = payloads([event])
    assert record.kind == "trajectory"
    assert record.specialist == "agent"
    assert record.record == {
        "messages": context_messages(AGENT_TURN),
        "actions": [dict(a) for a in ACTIONS],
        "answer": "4 and 9.",
        "reward": 2 / 3,
        "adapter_version": "agent@1",
        "release_id": "rel-1",
    }
    assert event.key == "experience.agent"
    assert event.causation_id == COMPLETED


@pytest.mark.parametrize(
    ("oks", "reward"),
    [((True,), 1.0), ((False,), 0.0), ((True, False), 0.5), ((False, False, False, True), 0.25)],
)
def test_the_reward_is_the_share_of_actions_that_succeeded(
    oks: tuple[bool, ...], reward: float
) -> None:
    actions: tuple[dict[str, Any], ...] = tuple(
        {"name": "calculator", "args": {}, "result": None, "ok": ok} for ok in oks
    )
    [record] = payloads(derive(replace(AGENT_TURN, actions=actions), completed()))
    assert record.record["reward"] == reward


@pytest.mark.parametrize(("valid", "reward"), [(True, 1.0), (False, 0.0)])
def test_a_completed_genui_turn_is_rewarded_by_its_trees_validity(
    valid: bool, reward: float
) -> None:
    ui = replace(CHAT_TURN, specialist="genui", response='{"type": "Text"}', genui_valid=valid)
    [record] = payloads(derive(ui, completed()))
    assert (record.kind, record.record["reward"], record.record["actions"]) == (
        "trajectory",
        reward,
        [],
    )


def test_a_completed_turn_without_actions_teaches_nothing() -> None:
    assert derive(CHAT_TURN, completed()) == []
    assert derive(replace(AGENT_TURN, actions=()), completed()) == []


def test_a_trajectory_is_recorded_even_without_an_answer() -> None:
    [record] = payloads(derive(replace(AGENT_TURN, response=None), completed()))
    assert record.record["answer"] is None


def test_the_trajectory_id_depends_on_the_completion_event() -> None:
    [first] = derive(AGENT_TURN, completed())
    [again] = derive(AGENT_TURN, completed())
    [up] = derive(AGENT_TURN, feedback("up"))
    assert first.event_id == again.event_id
    assert first.event_id != up.event_id


def test_other_events_teach_nothing() -> None:
    received = TurnReceived(
        conversation_id=CONVERSATION,
        turn_id=TURN,
        client_msg_id="m1",
        content="hi",
        harness=ROOT.stamp,
        release_id="rel-1",
    )
    assert derive(CHAT_TURN, recorded(received)) == []


# --- the context a record teaches -----------------------------------------------------------


def test_the_context_is_the_specialists_hcp_context_for_the_turn() -> None:
    messages = context_messages(CHAT_TURN)
    assert messages == build_context(ROOT, "chat", [], "What is the capital of France?").messages()
    assert messages[0]["role"] == "system"
    assert messages[-1] == {"role": "user", "content": "What is the capital of France?"}


def test_the_context_holds_the_seed_history_then_the_earlier_turns() -> None:
    seed = (
        ChatMessage(role="user", content="Hello"),
        ChatMessage(role="assistant", content="Hi there."),
    )
    turn = replace(
        CHAT_TURN,
        seed_history=seed,
        earlier=(("And Spain?", "Madrid."), ("And Italy?", None)),
    )
    history = [
        *seed,
        ChatMessage(role="user", content="And Spain?"),
        ChatMessage(role="assistant", content="Madrid."),
        ChatMessage(role="user", content="And Italy?"),
        ChatMessage(role="assistant", content=""),
    ]
    expected = build_context(ROOT, "chat", history, "What is the capital of France?").messages()
    assert context_messages(turn) == expected
    assert [m["content"] for m in expected[1:]] == [
        "Hello",
        "Hi there.",
        "And Spain?",
        "Madrid.",
        "And Italy?",
        "",
        "What is the capital of France?",
    ]


def test_an_agent_context_lists_the_tools() -> None:
    system = context_messages(AGENT_TURN)[0]["content"]
    assert "calculator" in system
    assert system != context_messages(CHAT_TURN)[0]["content"]


# --- regenerations ----------------------------------------------------------------------------

REGENERATED = UUID("0190f0a0-0000-7000-8000-000000000002")
SECOND = replace(CHAT_TURN, turn_id=REGENERATED, response="Paris, France.", regenerates=TURN)


def test_a_kept_regeneration_pairs_its_answer_over_the_one_it_replaced() -> None:
    found = payloads(derive(SECOND, feedback("up"), CHAT_TURN))
    assert [r.kind for r in found] == ["sft", "preference"]
    pair = found[1]
    assert pair.turn_id == REGENERATED
    assert pair.record["messages"] == context_messages(CHAT_TURN)  # the first answer's context
    assert (pair.record["chosen"], pair.record["rejected"]) == ("Paris, France.", "Paris.")


@pytest.mark.parametrize(
    "first",
    [
        replace(CHAT_TURN, response="Paris, France."),  # the same answer again
        replace(CHAT_TURN, specialist="agent"),  # served by another specialist
        replace(CHAT_TURN, response=None),  # never answered
    ],
)
def test_a_regeneration_pairs_nothing_unless_two_answers_of_one_specialist_differ(
    first: JoinedTurn,
) -> None:
    assert [r.kind for r in payloads(derive(SECOND, feedback("up"), first))] == ["sft"]


def test_only_thumbs_up_keeps_a_regeneration() -> None:
    found = payloads(derive(SECOND, feedback("down"), CHAT_TURN))
    assert [(r.kind, r.turn_id, r.record["reward"]) for r in found] == [
        ("trajectory", REGENERATED, 0.0)
    ]


# --- routing labels -------------------------------------------------------------------------


def labels(turn: JoinedTurn, event: RecordedEvent, replaced: JoinedTurn | None = None) -> Any:
    found = [e.payload for e in routing_labels(turn, event, replaced)]
    return [
        (p.turn_id, p.text, p.specialist, p.source) for p in found if isinstance(p, RoutingLabelled)
    ] + [p for p in found if not isinstance(p, RoutingLabelled)]


PICKED = replace(CHAT_TURN, specialist_hint="chat")
TEXT = CHAT_TURN.content


def test_a_users_pick_answered_by_that_specialist_is_a_hint_label() -> None:
    assert labels(PICKED, completed()) == [(TURN, TEXT, "chat", "hint")]
    assert labels(CHAT_TURN, completed()) == []  # the router chose: no evidence yet
    assert labels(replace(PICKED, specialist="agent"), completed()) == []  # not honoured
    chat_client = replace(PICKED, front_end="chat")
    assert labels(chat_client, completed()) == [(TURN, TEXT, "chat", "hint")]


def test_an_api_clients_model_field_is_an_api_model_label() -> None:
    """An OpenAI client names a model in its code, whatever the words: its own label source,
    which the router's fit weighs less."""
    api = replace(PICKED, front_end="openai")
    assert labels(api, completed()) == [(TURN, TEXT, "chat", "api_model")]


def test_a_reroute_labels_the_turns_words_with_the_named_specialist() -> None:
    corrected = recorded(RoutingCorrected(turn_id=TURN, specialist="genui"))
    [event] = routing_labels(CHAT_TURN, corrected)
    assert (event.key, event.causation_id, event.tenant_id) == ("routing", FEEDBACK, "acme")
    assert labels(CHAT_TURN, corrected) == [(TURN, TEXT, "genui", "correction")]
    assert derive(CHAT_TURN, corrected) == []  # no answer to learn from


def test_thumbs_up_confirms_the_routers_choice_and_down_teaches_routing_nothing() -> None:
    assert labels(CHAT_TURN, feedback("up")) == [(TURN, TEXT, "chat", "up")]
    assert labels(PICKED, feedback("up")) == []  # the pick was labelled when it completed
    assert labels(CHAT_TURN, feedback("down")) == []
    assert labels(CHAT_TURN, feedback("edit", "Paris!")) == []


def test_an_answer_of_another_specialist_kept_after_a_reroute_is_a_kept_label() -> None:
    rerouted = replace(SECOND, specialist="genui", specialist_hint="genui")
    assert labels(rerouted, feedback("up"), CHAT_TURN) == [(REGENERATED, TEXT, "genui", "kept")]
    assert labels(SECOND, feedback("up"), CHAT_TURN) == []  # the same specialist again
    assert labels(rerouted, completed()) == []  # a regeneration's hint is not a user's pick


def test_a_ui_event_is_not_a_users_words() -> None:
    ui = replace(PICKED, input_kind="ui_event")
    assert labels(ui, completed()) == labels(ui, feedback("up")) == []


# --- experience-2 ---------------------------------------------------------------------------


def test_experience_2_also_rewards_a_thumbs_up_1() -> None:
    sft, reward = payloads(experience_from(CHAT_TURN, feedback("up"), version="experience-2"))
    assert (sft.kind, reward.kind) == ("sft", "trajectory")
    assert {sft.filter_version, reward.filter_version} == {"experience-2"}
    assert reward.record["reward"] == 1.0 and reward.record["answer"] == "Paris."
    [v1] = payloads(derive(CHAT_TURN, feedback("up")))
    assert sft.record == v1.record  # the rules it keeps derive the same records
    assert sft.experience_id != v1.experience_id  # under ids of its own


@pytest.mark.parametrize("kind", ["down", "regenerate", "edit"])
def test_experience_2_derives_the_rest_as_experience_1(kind: str) -> None:
    event = feedback(kind, "Paris, France." if kind == "edit" else None)
    v1 = payloads(derive(CHAT_TURN, event))
    v2 = payloads(experience_from(CHAT_TURN, event, version="experience-2"))
    assert [(r.kind, r.record) for r in v2] == [(r.kind, r.record) for r in v1]
