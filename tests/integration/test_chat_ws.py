"""The WebSocket chat protocol against a real server: tiny real model, router, PostgreSQL log."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from core.events import RouterDecided, TurnReceived
from infra.local_stack import LocalStack
from server.router import RouterService
from tests.serving import Running, frames_until, send, serving

TURN_EVENTS = ["TurnReceived", "RouterDecided", "ModelResponded", "TurnCompleted"]


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
        max_new_tokens=12,
        turns_per_minute=1000,
        max_connections_per_tenant=3,
    ) as running:
        yield running


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_a_turn_streams_tokens_and_every_step_is_in_the_log(served: Running) -> None:
    key = served.key(tenant())
    with served.connect(key) as ws:
        [ready] = frames_until(ws, "ready")
        assert ready["release_id"].startswith("rel-") and "conversation_id" not in ready
        send(ws, type="user_turn", client_msg_id="m1", content="write a python function")
        frames = frames_until(ws, "turn_completed")
    started, *middle, completed = frames
    assert started["type"] == "turn_started" and started["specialist"] == "coding"
    assert started["adapter_version"] == "coding@0"
    tokens = [f["delta"] for f in middle if f["type"] == "token"]
    assert tokens and completed["usage"]["completion_tokens"] > 0
    events = served.events(started["conversation_id"])
    assert [e.envelope.type for e in events] == ["ConversationStarted", *TURN_EVENTS]
    responded = events[3].payload
    assert responded.text == "".join(tokens)
    assert isinstance(events[1].payload, TurnReceived) and events[1].payload.front_end == "chat"
    assert {e.envelope.tenant_id for e in events} == {ready["tenant_id"]}
    for event in events[1:]:
        assert event.envelope.payload["harness"] == {
            "harness_version": "harness@0",
            "hcp_version": "hcp-1",
        }


def test_a_short_follow_up_stays_with_the_specialist_that_answered(
    served: Running, router: RouterService
) -> None:
    """ "can you give an example?" alone reads as chat; after a coding turn it stays with
    coding, and ``RouterDecided`` records the previous specialist it read."""
    follow_up = "can you give an example?"
    assert router.route(follow_up).specialist != "coding"
    key = served.key(tenant())
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="m1", content="write a python function")
        first = frames_until(ws, "turn_completed")
        send(ws, type="user_turn", client_msg_id="m2", content=follow_up)
        second = frames_until(ws, "turn_completed")
    assert first[0]["specialist"] == second[0]["specialist"] == "coding"
    events = served.events(first[0]["conversation_id"])
    decided = [e.payload for e in events if isinstance(e.payload, RouterDecided)]
    assert [(d.reason, d.previous) for d in decided] == [
        ("classifier", None),
        ("follow_up", "coding"),
    ]


def test_the_key_may_come_in_a_hello_frame(served: Running) -> None:
    key = served.key(tenant())
    with served.connect() as ws:
        send(ws, type="hello", api_key=key)
        assert frames_until(ws, "ready")[0]["type"] == "ready"
        send(ws, type="ping")
        assert frames_until(ws, "pong")[-1] == {"type": "pong"}


@pytest.mark.parametrize(
    "first",
    [
        {"type": "hello", "api_key": "mk_" + "x" * 43},
        {"type": "hello"},
        {"type": "ping"},
        "not json",
    ],
)
def test_without_a_valid_key_the_socket_closes_with_4401(served: Running, first: object) -> None:
    with served.connect() as ws:
        ws.send(first if isinstance(first, str) else json.dumps(first))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    assert closed.value.rcvd.reason


def test_a_bad_bearer_key_closes_with_4401(served: Running) -> None:
    with served.connect("mk_wrong") as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


def test_a_resent_message_never_makes_a_second_turn_and_conversations_resume(
    served: Running,
) -> None:
    key = served.key(tenant())
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="same", content="hello there")
        first = frames_until(ws, "turn_completed")
    conversation_id = first[0]["conversation_id"]
    text = "".join(f["delta"] for f in first if f["type"] == "token")
    with served.connect(key) as ws:  # a reconnect: resume, then resend
        frames_until(ws, "ready")
        send(ws, type="hello", conversation_id=conversation_id)
        assert frames_until(ws, "ready")[-1]["conversation_id"] == conversation_id
        send(ws, type="user_turn", client_msg_id="same", content="hello there")
        again = frames_until(ws, "turn_completed")
        assert again[0]["turn_id"] == first[0]["turn_id"] and again[-1]["resent"] is True
        assert "".join(f["delta"] for f in again if f["type"] == "token") == text
        send(ws, type="user_turn", client_msg_id="next", content="and then?")
        follow_up = frames_until(ws, "turn_completed")
        assert follow_up[0]["conversation_id"] == conversation_id
    types = [e.envelope.type for e in served.events(conversation_id)]
    assert types == ["ConversationStarted", *TURN_EVENTS, *TURN_EVENTS]


def test_cancel_stops_generation(served: Running) -> None:
    key = served.key(tenant())
    served.server.chat.limits = served.server.chat.limits.__class__(
        turns_per_minute=1000, max_new_tokens=4000
    )
    try:
        with served.connect(key) as ws:
            frames_until(ws, "ready")
            send(ws, type="user_turn", client_msg_id="long", content="tell me a long story")
            started = frames_until(ws, "turn_started")[-1]
            send(ws, type="cancel", turn_id=started["turn_id"])
            completed = frames_until(ws, "turn_completed")[-1]
    finally:
        served.server.chat.limits = served.server.chat.limits.__class__(
            turns_per_minute=1000, max_new_tokens=12
        )
    assert completed["finish_reason"] == "cancelled"
    assert completed["usage"]["completion_tokens"] < 4000
    events = served.events(started["conversation_id"])
    assert events[-2].payload.finish_reason == "cancelled"


def test_bad_frames_get_typed_errors_and_the_connection_goes_on(served: Running) -> None:
    key = served.key(tenant())
    with served.connect(key) as ws:
        [ready] = frames_until(ws, "ready")
        bad: list[str | bytes] = [
            b"\x00\x01binary",
            "{not json",
            "[1, 2]",
            json.dumps({"type": "nope"}),
            json.dumps({"type": "user_turn", "content": "no id"}),
            json.dumps({"type": "user_turn", "client_msg_id": "x", "content": "x" * 16001}),
            json.dumps({"type": "ping", "extra": 1}),
            json.dumps({"type": "cancel", "turn_id": str(uuid.uuid4())}),
        ]
        for frame in bad:
            ws.send(frame)
            error = frames_until(ws, "error")[-1]
            assert error["code"] in {"invalid_frame", "turn_not_found"}
            assert error["message"] and error["retryable"] is False
        send(ws, type="ping")
        assert frames_until(ws, "pong")
    assert not [e for e in served.events() if e.envelope.tenant_id == ready["tenant_id"]]


def test_an_oversized_frame_closes_with_1009(served: Running) -> None:
    key = served.key(tenant())
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        ws.send("x" * (served.settings.max_frame_bytes + 1))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_connections_per_tenant_are_limited(served: Running) -> None:
    key = served.key(tenant())
    with ExitStack() as stack:
        for _ in range(3):
            frames_until(stack.enter_context(served.connect(key)), "ready")
        with served.connect(key) as extra:
            error = frames_until(extra, "error")[-1]
            assert error["code"] == "too_many_connections" and error["retryable"] is True
            with pytest.raises(ConnectionClosed) as closed:
                extra.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013


def test_tenants_never_see_each_others_conversations(served: Running) -> None:
    alice, mallory = served.key(tenant()), served.key(tenant())
    with served.connect(alice) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="a1", content="my secret plans")
        started = frames_until(ws, "turn_completed")[0]
    conversation_id, turn_id = started["conversation_id"], started["turn_id"]
    before = len(served.events(conversation_id))
    with served.connect(mallory) as ws:
        frames_until(ws, "ready")
        send(ws, type="hello", conversation_id=conversation_id)
        assert frames_until(ws, "error")[-1]["code"] == "conversation_not_found"
        send(
            ws, type="user_turn", client_msg_id="m1", content="hi", conversation_id=conversation_id
        )
        assert frames_until(ws, "error")[-1]["code"] == "conversation_not_found"
        send(ws, type="feedback", turn_id=turn_id, kind="down")
        assert frames_until(ws, "error")[-1]["code"] == "turn_not_found"
    with served.connect() as ws:  # resuming at hello time is refused too
        send(ws, type="hello", api_key=mallory, conversation_id=conversation_id)
        assert frames_until(ws, "error")[-1]["code"] == "conversation_not_found"
    url = f"{served.http}/v1/conversations/{conversation_id}"
    stolen = httpx.get(url, headers={"Authorization": f"Bearer {mallory}"})
    assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "conversation_not_found"
    own = httpx.get(url, headers={"Authorization": f"Bearer {alice}"})
    assert own.status_code == 200 and own.json()["turns"][0]["content"] == "my secret plans"
    assert httpx.get(url).status_code == 401
    assert len(served.events(conversation_id)) == before  # nothing was written for mallory
