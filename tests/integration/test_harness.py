"""The harness end to end over the WebSocket: agent tools with state rebuilt by replay, GenUI
validation and ui_events, feedback. The model's side is played by ``InstantEngine`` with a
script, because what is under test is the harness around the model, not the model."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.conversation import Conversation
from core.errors import ConfigError
from core.events import (
    ExperienceRecorded,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    RoutingCorrected,
    RoutingLabelled,
    TurnReceived,
)
from core.harness.actions import MAX_ACTIONS_PER_TURN, ActionOutcome, replay, verify_replay
from engines.instant import InstantEngine
from infra.local_stack import LocalStack
from macaron import wiring
from macaron.cli import app
from server.router import RouterService
from streams.experience_rules import ExperienceBuilder
from streams.runner import catch_up
from tests.serving import Running, frames_until, send, serving

CARD = {
    "type": "Card",
    "title": "Plan",
    "children": [
        {"type": "Text", "text": "Pick one"},
        {"type": "Button", "id": "go", "label": "Go", "action": "start"},
    ],
}
AGENT_SCRIPTS: dict[str, list[dict[str, Any] | str]] = {
    "remember milk and compute": [
        {"tool": "notes", "args": {"op": "set", "key": "shopping", "value": "milk"}},
        {"tool": "calculator", "args": {"expression": "6*7"}},
        {"tool": "clock", "args": {}},
        "Noted milk; 6*7 is 42.",
    ],
    "plan my day": [
        {"tool": "todo", "args": {"op": "add", "text": "buy milk"}},
        {"tool": "todo", "args": {"op": "add", "text": "call mum"}},
        {"tool": "todo", "args": {"op": "complete", "id": 1}},
        {"tool": "calculator", "args": {"expression": "1/0"}},
        "Two todos, one done.",
    ],
    "loop forever": [{"tool": "clock", "args": {}}] * 10,
}


def script(messages: list[dict[str, str]]) -> str:
    """Answers by the last user words, and for the agent by how many tool results came back."""
    user = max(
        i
        for i, m in enumerate(messages)
        if m["role"] == "user" and not m["content"].startswith("Tool result:")
    )
    content, step = messages[user]["content"], len(messages) - user - 1
    steps = len([m for m in messages[user:] if m["content"].startswith("Tool result:")])
    if content in AGENT_SCRIPTS:
        answer = AGENT_SCRIPTS[content][steps]
        return answer if isinstance(answer, str) else json.dumps(answer)
    if content == "show me a card":
        return json.dumps(CARD)
    if content == "show me a broken view":
        return json.dumps({"type": "Table", "columns": ["a", "b"], "rows": [["only one"]]})
    if content.startswith("ui_event "):
        return json.dumps(
            {"type": "Text", "text": f"you pressed {json.loads(content[9:])['component_id']}"}
        )
    asked_before = sum(m["role"] == "user" and m["content"] == content for m in messages[:user])
    return f"plain answer {step}" + " again" * asked_before


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    with serving(
        stack,
        tmp_path_factory,
        router=router,
        model_dir=tiny_model,
        engine=InstantEngine(script),
        turns_per_minute=1000,
    ) as running:
        yield running


def turn(served: Running, ws: Any, content: str, hint: str | None = None) -> list[dict[str, Any]]:
    frame: dict[str, Any] = {"client_msg_id": str(uuid.uuid4()), "content": content}
    if hint:
        frame["specialist_hint"] = hint
    send(ws, type="user_turn", **frame)
    return frames_until(ws, "turn_completed")


def test_agent_actions_are_events_and_replay_rebuilds_the_same_state(served: Running) -> None:
    key = served.key("agent-tenant")
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        first = turn(served, ws, "remember milk and compute", "agent")
        second = turn(served, ws, "plan my day", "agent")
    actions = [f for f in first + second if f["type"] == "action"]
    assert [a["name"] for a in actions] == [
        "notes",
        "calculator",
        "clock",
        "todo",
        "todo",
        "todo",
        "calculator",
    ]
    assert actions[1]["result"] == {"value": 42} and actions[1]["ok"] is True
    assert (
        actions[-1]["ok"] is False and actions[-1]["result"]["error"]["code"] == "division_by_zero"
    )
    tokens = "".join(f["delta"] for f in second if f["type"] == "token")
    assert tokens == "Two todos, one done."  # tool-call JSON is never streamed as text

    conversation_id = first[0]["conversation_id"]
    events = served.events(conversation_id)
    recorded = [e for e in events if isinstance(e.payload, HarnessActionExecuted)]
    assert len(recorded) == 7
    cached = served.server.chat.store.cached(uuid.UUID(conversation_id))
    assert cached is not None
    live = cached.tool_state
    rebuilt = Conversation.replay(events)
    assert rebuilt is not None and rebuilt.tool_state == live
    outcomes = [
        ActionOutcome(
            e.payload.name, e.payload.args, e.payload.result, e.payload.ok, e.payload.state_delta
        )
        for e in recorded
    ]
    assert replay(outcomes) == live
    times = [e.envelope.occurred_at for e in recorded]
    assert verify_replay(outcomes, times) == live  # re-executed, the clock replays as recorded
    assert live["notes"] == {"shopping": "milk"}
    assert live["todos"] == {
        "1": {"text": "buy milk", "done": True},
        "2": {"text": "call mum", "done": False},
    }


def test_a_turn_stops_after_the_action_limit(served: Running) -> None:
    with served.connect(served.key("agent-tenant")) as ws:
        frames_until(ws, "ready")
        frames = turn(served, ws, "loop forever", "agent")
    assert len([f for f in frames if f["type"] == "action"]) == MAX_ACTIONS_PER_TURN
    text = "".join(f["delta"] for f in frames if f["type"] == "token")
    assert f"after {MAX_ACTIONS_PER_TURN} actions" in text


def test_genui_trees_are_validated_and_ui_events_come_back_as_turns(served: Running) -> None:
    with served.connect(served.key("genui-tenant")) as ws:
        frames_until(ws, "ready")
        good = turn(served, ws, "show me a card", "genui")
        bad = turn(served, ws, "show me a broken view", "genui")
        [tree] = [f["tree"] for f in good if f["type"] == "genui"]
        assert tree == CARD
        assert not [f for f in bad if f["type"] == "genui"]  # never an invalid tree
        fallback = "".join(f["delta"] for f in bad if f["type"] == "token")
        assert "could not render" in fallback
        send(ws, type="ui_event", turn_id=good[0]["turn_id"], component_id="nope", action="x")
        assert frames_until(ws, "error")[-1]["code"] == "invalid_frame"
        send(ws, type="ui_event", turn_id=good[0]["turn_id"], component_id="go", action="start")
        answer = frames_until(ws, "turn_completed")
    assert [f["tree"] for f in answer if f["type"] == "genui"] == [
        {"type": "Text", "text": "you pressed go"}
    ]
    events = served.events(good[0]["conversation_id"])
    rendered = [e.payload for e in events if isinstance(e.payload, GenUIRendered)]
    assert [r.valid for r in rendered] == [True, False, True]
    assert rendered[1].errors and rendered[1].errors[0].startswith("rows.0")
    ui_turn = [e.payload for e in events if isinstance(e.payload, TurnReceived)][-1]
    assert ui_turn.input_kind == "ui_event" and json.loads(ui_turn.content[9:]) == {
        "turn_id": good[0]["turn_id"],
        "component_id": "go",
        "action": "start",
        "value": None,
    }


def test_feedback_is_recorded_and_regenerate_answers_again(served: Running) -> None:
    with served.connect(served.key("feedback-tenant")) as ws:
        frames_until(ws, "ready")
        answered = turn(served, ws, "hello")
        turn_id = answered[0]["turn_id"]
        send(ws, type="feedback", turn_id=turn_id, kind="up")
        send(ws, type="feedback", turn_id=turn_id, kind="edit")  # edit needs the text
        assert frames_until(ws, "error")[-1]["code"] == "invalid_frame"
        send(ws, type="feedback", turn_id=turn_id, kind="edit", edited_text="Hello to you!")
        send(ws, type="feedback", turn_id=turn_id, kind="regenerate")
        again = frames_until(ws, "turn_completed")
        send(ws, type="feedback", turn_id=again[0]["turn_id"], kind="up")  # the second is kept
        send(ws, type="ping")
        frames_until(ws, "pong")
    assert again[0]["turn_id"] != turn_id
    events = served.events(answered[0]["conversation_id"])
    feedback = [e.payload for e in events if isinstance(e.payload, FeedbackGiven)]
    assert [(f.kind, f.edited_text) for f in feedback] == [
        ("up", None),
        ("edit", "Hello to you!"),
        ("regenerate", None),
        ("up", None),
    ]
    received = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert [(r.content, r.regenerates) for r in received] == [
        ("hello", None),
        ("hello", uuid.UUID(turn_id)),
    ]
    assert_the_kept_regeneration_is_a_preference_pair(served, turn_id, again[0]["turn_id"])
    rebuilt = Conversation.replay(events)
    assert rebuilt is not None and rebuilt.turns[uuid.UUID(turn_id)].answer == "Hello to you!"


def assert_the_kept_regeneration_is_a_preference_pair(
    served: Running, first: str, second: str
) -> None:
    """Through the experience builder: the kept second answer is chosen over the first, in the
    first turn's context."""
    hosts = wiring.processor_hosts(served.settings, served.server.log, served.server.pool)
    [builder] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(builder)
    pairs = [
        e.payload
        for e in served.events("experience.chat")
        if isinstance(e.payload, ExperienceRecorded)
        and e.payload.kind == "preference"
        and str(e.payload.turn_id) == second
    ]
    [pair] = pairs
    assert (pair.record["chosen"], pair.record["rejected"]) == (
        "plain answer 0 again",
        "plain answer 0",
    )
    messages: Any = pair.record["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello"]
    assert first != second


GREETING = "hello there, how has your day been so far, my friend?"


def test_a_reroute_answers_again_with_the_named_specialist_and_teaches_the_router(
    served: Running,
) -> None:
    """Over the WebSocket: a ``reroute`` frame records the correction and the turn's words are
    answered by the named specialist; bad reroutes get typed errors and change nothing; the
    experience builder turns the user's own pick, the correction and the kept answer into
    routing labels."""
    with served.connect(served.key("routing-tenant")) as ws:
        frames_until(ws, "ready")
        picked = turn(served, ws, "show me a card", "genui")
        answered = turn(served, ws, GREETING)  # not a short follow-up of the genui turn
        turn_id = answered[0]["turn_id"]
        for specialist, code in [("poetry", "unknown_specialist"), ("chat", "invalid_frame")]:
            send(ws, type="reroute", turn_id=turn_id, specialist=specialist)
            assert frames_until(ws, "error")[-1]["code"] == code
        send(ws, type="reroute", turn_id=str(uuid.uuid4()), specialist="genui")
        assert frames_until(ws, "error")[-1]["code"] == "turn_not_found"
        send(ws, type="reroute", turn_id=turn_id, specialist="Genui!")
        assert frames_until(ws, "error")[-1]["code"] == "invalid_frame"
        send(ws, type="reroute", turn_id=turn_id, specialist="genui")
        again = frames_until(ws, "turn_completed")
        send(ws, type="feedback", turn_id=again[0]["turn_id"], kind="up")
        send(ws, type="ping")
        frames_until(ws, "pong")
    assert answered[0]["specialist"] == "chat" and again[0]["specialist"] == "genui"
    events = served.events(answered[0]["conversation_id"])
    corrected = [e.payload for e in events if isinstance(e.payload, RoutingCorrected)]
    assert [(str(c.turn_id), c.specialist) for c in corrected] == [(turn_id, "genui")]
    received = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert [(r.content, str(r.regenerates)) for r in received][-1] == (GREETING, turn_id)
    hosts = wiring.processor_hosts(served.settings, served.server.log, served.server.pool)
    [builder] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(builder)
    mine = {picked[0]["turn_id"], turn_id, again[0]["turn_id"]}
    labels = [
        (str(e.payload.turn_id), e.payload.text, e.payload.specialist, e.payload.source)
        for e in served.events("routing")
        if isinstance(e.payload, RoutingLabelled) and str(e.payload.turn_id) in mine
    ]
    assert labels == [
        (picked[0]["turn_id"], "show me a card", "genui", "hint"),
        (turn_id, GREETING, "genui", "correction"),
        (again[0]["turn_id"], GREETING, "genui", "kept"),
    ]


def test_a_tenant_set_not_to_train_teaches_nothing_from_then_on(served: Running) -> None:
    """``macaron tenants set T --training off`` records ``TenantTrainingSet``; the experience
    builder derives no record and no routing label from T's later traffic, and others go on
    teaching. An unknown tenant is a clear error and writes nothing."""
    env = {
        f"MACARON_{k.upper()}": str(v)
        for k, v in served.settings.model_dump(exclude_none=True).items()
    }
    quiet, loud = served.key("quiet-tenant"), served.key("loud-tenant")
    before = len(served.events("tenants"))
    cli = CliRunner()  # in this process: a subprocess per command costs seconds of imports
    unknown = cli.invoke(app, ["tenants", "set", "nobody", "--training", "off"], env=env)
    assert isinstance(unknown.exception, ConfigError)
    assert "no tenant 'nobody'" in unknown.exception.message
    assert len(served.events("tenants")) == before
    done = cli.invoke(app, ["tenants", "set", "quiet-tenant", "--training", "off"], env=env)
    assert done.exit_code == 0, done.output
    turns = {}
    for name, key in [("quiet-tenant", quiet), ("loud-tenant", loud)]:
        with served.connect(key) as ws:
            frames_until(ws, "ready")
            answered = turn(served, ws, "show me a card", "genui")
            send(ws, type="feedback", turn_id=answered[0]["turn_id"], kind="up")
            send(ws, type="ping")
            frames_until(ws, "pong")
        turns[name] = answered[0]["turn_id"]
    hosts = wiring.processor_hosts(served.settings, served.server.log, served.server.pool)
    [builder] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(builder)
    derived = [
        e
        for e in served.events()
        if isinstance(e.payload, ExperienceRecorded | RoutingLabelled)
        and str(e.payload.turn_id) in turns.values()
    ]
    assert {e.envelope.tenant_id for e in derived} == {"loud-tenant"}
    assert {type(e.payload) for e in derived} == {ExperienceRecorded, RoutingLabelled}
    listed = cli.invoke(app, ["tenants", "list"], env={**env, "COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    rows = {
        line.split()[1]: line.split()[3] for line in listed.output.splitlines() if "-tenant" in line
    }
    assert rows["quiet-tenant"] == "off" and rows["loud-tenant"] == "on"
