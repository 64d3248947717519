"""The OpenAI-compatible API, driven by the official ``openai`` client against a real server."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from core.events import (
    ConversationStarted,
    ExperienceRecorded,
    FeedbackGiven,
    HarnessActionExecuted,
    ModelResponded,
    RouterDecided,
    RoutingCorrected,
    RoutingLabelled,
    TurnReceived,
)
from infra.local_stack import LocalStack
from macaron import wiring
from server.router import RouterService
from streams.experience_rules import ExperienceBuilder
from streams.runner import catch_up
from tests.serving import Running, frames_until, send, serving


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    with serving(
        stack, tmp_path_factory, router=router, model_dir=tiny_model, max_new_tokens=10
    ) as running:
        yield running


@pytest.fixture(scope="module")
def tooled(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """A server whose answers may be long enough for a call with a free string argument."""
    with serving(
        stack, tmp_path_factory, router=router, model_dir=tiny_model, max_new_tokens=160
    ) as running:
        yield running


_OPEN: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Each test's clients are closed after it (an open pooled socket would be a warning)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def client(served: Running, key: str) -> openai.OpenAI:
    made = openai.OpenAI(base_url=f"{served.http}/v1", api_key=key, max_retries=0)
    _OPEN.append(made)
    return made


def test_models_lists_the_specialists_with_their_adapter_versions(served: Running) -> None:
    models = client(served, served.key("oa-models")).models.list()
    by_id = {m.id: m for m in models.data}
    assert set(by_id) == {"auto", "chat", "agent", "coding", "genui"}
    assert by_id["coding"].model_extra is not None
    assert by_id["coding"].model_extra["adapter_version"] == "coding@0"


def test_a_completion_is_a_recorded_turn(served: Running) -> None:
    key = served.key("oa-tenant")
    reply = client(served, key).chat.completions.create(
        model="auto",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "write a python function that adds numbers"},
        ],
    )
    assert reply.model == "coding" and reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    extra = reply.model_extra or {}
    conversation_id = extra["macaron"]["conversation_id"]
    events = served.events(conversation_id)
    assert {e.envelope.tenant_id for e in events} == {"oa-tenant"}
    started = events[0].payload
    assert isinstance(started, ConversationStarted)
    assert [(m.role, m.content) for m in started.history] == [("system", "Be brief.")]
    [responded] = [e.payload for e in events if isinstance(e.payload, ModelResponded)]
    assert responded.text == reply.choices[0].message.content


def test_streaming_with_a_named_specialist(served: Running) -> None:
    stream = client(served, served.key("oa-stream")).chat.completions.create(
        model="genui",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"genui"}
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # usage comes last, alone
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    extra = chunks[0].model_extra or {}
    events = served.events(extra["macaron"]["conversation_id"])
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.front_end == "openai"
    assert received.specialist_hint == "genui" and text  # the random model's tree is invalid:
    assert "could not render" in text  # the user got the text fallback


def test_errors_are_typed(served: Running) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(served, "mk_" + "a" * 43).models.list()
    api = client(served, served.key("oa-errors"))
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "unknown_specialist"
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model="auto", messages=[{"role": "assistant", "content": "x"}])
    assert bad.value.code == "invalid_frame"
    raw = httpx.post(
        f"{served.http}/v1/chat/completions",
        content=b"\xff{",
        headers={"Authorization": f"Bearer {served.key('oa-errors')}"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_frame"
    assert not [e for e in served.events() if e.envelope.tenant_id == "oa-errors"]


def test_a_chat_key_cannot_be_used_without_its_scope(served: Running) -> None:
    admin_only = served.key(f"oa-{uuid.uuid4().hex[:6]}", "admin")
    with pytest.raises(openai.PermissionDeniedError):
        client(served, admin_only).models.list()


def test_feedback_and_reroute_over_http_teach_as_the_websocket_does(served: Running) -> None:
    """A client of the OpenAI API gives feedback on a completion and asks another specialist,
    naming the conversation and turn the completion's ``macaron`` block gave."""
    key = served.key("oa-feedback")
    reply = client(served, key).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello there"}]
    )
    ids = (reply.model_extra or {})["macaron"]
    turn = f"{served.http}/v1/conversations/{ids['conversation_id']}/turns/{ids['turn_id']}"
    auth = {"Authorization": f"Bearer {key}"}

    def post(path: str, body: object, headers: dict[str, str] = auth) -> httpx.Response:
        return httpx.post(f"{turn}/{path}", json=body, headers=headers, timeout=60)

    up = post("feedback", {"kind": "up"})
    assert up.status_code == 200 and up.json() == {
        "turn_id": ids["turn_id"],
        "kind": "up",
        "recorded": True,
    }
    for path, body, status, code in [
        ("feedback", {"kind": "edit"}, 400, "invalid_frame"),  # an edit needs its text
        ("feedback", {"kind": "meh"}, 400, "invalid_frame"),
        ("feedback", {"kind": "up", "extra": 1}, 400, "invalid_frame"),
        ("reroute", {"specialist": "chat"}, 400, "invalid_frame"),  # it answered already
        ("reroute", {"specialist": "poetry"}, 404, "unknown_specialist"),
    ]:
        refused = post(path, body)
        assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), body
    other = {"Authorization": f"Bearer {served.key('oa-other')}"}
    before = served.events(ids["conversation_id"])
    assert post("feedback", {"kind": "down"}, other).status_code == 404  # another tenant's
    assert post("reroute", {"specialist": "coding"}, other).status_code == 404
    assert served.events(ids["conversation_id"]) == before  # nothing written in its name
    assert post("feedback", {"kind": "down"}, {}).status_code == 401
    unknown = httpx.post(
        f"{served.http}/v1/conversations/{ids['conversation_id']}/turns/{uuid.uuid4()}/feedback",
        json={"kind": "up"},
        headers=auth,
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "turn_not_found"

    again = post("feedback", {"kind": "regenerate"})
    assert again.status_code == 200 and again.json()["object"] == "chat.completion"
    rerouted = post("reroute", {"specialist": "coding"})
    assert rerouted.status_code == 200 and rerouted.json()["model"] == "coding"
    events = served.events(ids["conversation_id"])
    kinds = [e.payload.kind for e in events if isinstance(e.payload, FeedbackGiven)]
    assert kinds == ["up", "regenerate"]
    [corrected] = [e.payload for e in events if isinstance(e.payload, RoutingCorrected)]
    assert (str(corrected.turn_id), corrected.specialist) == (ids["turn_id"], "coding")
    received = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert [str(r.regenerates) for r in received] == ["None", ids["turn_id"], ids["turn_id"]]
    assert [r.front_end for r in received] == ["openai", "chat", "chat"]
    assert [
        again.json()["macaron"]["turn_id"],
        rerouted.json()["macaron"]["turn_id"],
    ] == [str(r.turn_id) for r in received[1:]]


def test_a_context_longer_than_the_model_takes_is_a_typed_400_and_closes_the_turn(
    served: Running,
) -> None:
    """A 15,000-character message (the protocol allows 16,000) is more tokens than the model
    takes: 400 ``context_length_exceeded`` over HTTP and an error frame over the WebSocket;
    each turn is closed in the log by a response of finish ``error``, nothing left open."""
    long = ("ab1 " * 3750)[:15_000]
    key = served.key("oa-long")
    with pytest.raises(openai.BadRequestError) as refused:
        client(served, key).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": long}]
        )
    assert refused.value.code == "context_length_exceeded"
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="long", content=long, specialist_hint="chat")
        error = frames_until(ws, "error")[-1]
    assert error["code"] == "context_length_exceeded" and not error["retryable"]
    received = [
        e
        for e in served.events()
        if isinstance(e.payload, TurnReceived) and e.payload.content == long
    ]
    assert len(received) == 2
    for turn in received:
        events = served.events(turn.envelope.key)
        [responded] = [e.payload for e in events if isinstance(e.payload, ModelResponded)]
        assert responded.finish_reason == "error"


def test_the_sampling_parameters_clients_send_are_applied_and_recorded(served: Running) -> None:
    """``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop``
    reach the engine and the turn's ``TurnReceived.decoding``; content may come as text parts
    and ``developer`` is a system message; a parameter not applied is refused by name."""
    oa = client(served, served.key("oa-params"))
    asked: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "stop": "zq"}
    same = [
        oa.chat.completions.create(
            model="chat",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "hi"}],
                },
            ],
            max_tokens=6,
            **asked,
        )
        for _ in range(2)
    ]
    assert same[0].choices[0].message.content == same[1].choices[0].message.content  # one seed
    assert same[0].usage is not None and same[0].usage.completion_tokens <= 6
    ids = (same[0].model_extra or {})["macaron"]
    events = served.events(ids["conversation_id"])
    [started] = [e.payload for e in events if isinstance(e.payload, ConversationStarted)]
    assert [(m.role, m.content) for m in started.history] == [("system", "Be brief.")]
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.content == "say hi"
    assert received.decoding is not None
    assert received.decoding.model_dump() == {
        "max_tokens": 6,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "stop": ("zq",),
        "output": None,
        "json_schema": None,
        "or_text": False,
    }
    short = oa.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2
    )
    assert short.usage is not None and short.usage.completion_tokens <= 2
    plain = oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    plain_ids = (plain.model_extra or {})["macaron"]
    [default] = [
        e.payload
        for e in served.events(plain_ids["conversation_id"])
        if isinstance(e.payload, TurnReceived)
    ]
    assert default.decoding is None  # the harness's settings
    for done in (ids, plain_ids):  # a thumbs-up on each
        httpx.post(
            f"{served.http}/v1/conversations/{done['conversation_id']}/turns/"
            f"{done['turn_id']}/feedback",
            json={"kind": "up"},
            headers={"Authorization": f"Bearer {served.key('oa-params')}"},
        ).raise_for_status()
    hosts = wiring.processor_hosts(served.settings, served.server.log, served.server.pool)
    [builder] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(builder)
    taught = {
        str(e.payload.turn_id)
        for e in served.events("experience.chat")
        if isinstance(e.payload, ExperienceRecorded)
    }
    assert plain_ids["turn_id"] in taught  # the harness's decoding: an SFT example
    assert ids["turn_id"] not in taught  # the client's own decoding teaches no adapter
    sources = {
        str(e.payload.turn_id): e.payload.source
        for e in served.events("routing")
        if isinstance(e.payload, RoutingLabelled)
    }
    assert sources[plain_ids["turn_id"]] == "api_model"  # the client's model field, weighed less
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
    ]
    for refused, name in refusals:
        with pytest.raises(openai.BadRequestError) as caught:
            oa.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], **refused
            )
        assert caught.value.code == "unsupported_parameter" and name in str(caught.value)
    accepted = oa.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], n=1, presence_penalty=0
    )
    assert accepted.choices[0].finish_reason in {"stop", "length"}
    with pytest.raises(openai.BadRequestError) as caught:
        oa.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stop=["a"] * 5
        )
    assert caught.value.code == "invalid_frame"


def test_one_model_is_retrieved_by_id(served: Running) -> None:
    oa = client(served, served.key("oa-model"))
    coding = oa.models.retrieve("coding")
    assert coding.id == "coding" and (coding.model_extra or {})["adapter_version"] == "coding@0"
    assert oa.models.retrieve("auto").id == "auto"
    with pytest.raises(openai.NotFoundError) as caught:
        oa.models.retrieve("poetry")
    assert caught.value.code == "unknown_specialist"


def test_response_format_constrains_the_answer_while_decoding(served: Running) -> None:
    """``json_schema`` (a bounded schema): the random tiny model's answer is valid against it
    by construction; ``json_object``: a JSON value; an unbounded schema is refused (422)."""
    oa = client(served, served.key("oa-format"))
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    message: Any = [{"role": "user", "content": "are you ok?"}]
    shaped = oa.chat.completions.create(
        model="agent",  # a JSON answer in the client's format is not run as a tool call
        messages=message,
        max_tokens=32,
        response_format=as_format(
            {"type": "json_schema", "json_schema": {"name": "status", "schema": schema}}
        ),
    )
    answer = json.loads(shaped.choices[0].message.content or "")
    assert set(answer) == {"ok"} and isinstance(answer["ok"], bool)
    ids = (shaped.model_extra or {})["macaron"]
    events = served.events(ids["conversation_id"])
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.decoding is not None and received.decoding.json_schema == schema
    assert not [e for e in events if isinstance(e.payload, HarnessActionExecuted)]
    anything = oa.chat.completions.create(
        model="chat",
        messages=message,
        max_tokens=64,
        response_format=as_format({"type": "json_object"}),
    )
    text = anything.choices[0].message.content or ""
    if anything.choices[0].finish_reason == "stop":
        json.loads(text)  # complete: valid JSON
    else:
        assert text[:1] in set('{["-0123456789tfn')  # cut at max_tokens inside a JSON value
    loose = {"type": "object", "properties": {"note": {"type": "string"}}}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(
            model="chat",
            messages=message,
            response_format=as_format(
                {"type": "json_schema", "json_schema": {"name": "x", "schema": loose}}
            ),
        )
    assert caught.value.code == "grammar_unbounded"


def as_format(value: dict[str, Any]) -> Any:
    """A ``response_format`` as the client sends it (the SDK's typed dicts, untyped here)."""
    return value


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK: Any = {"type": "function", "function": {"name": "get_time", "description": "The time."}}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_required_tool_call_comes_back_as_openai_tool_calls_and_runs_nothing(
    tooled: Running,
) -> None:
    """The random tiny model, constrained to the client's tool schema, answers with a call of
    it: returned as ``tool_calls`` (the arguments valid against the schema, strings bounded),
    recorded with the schema it was decoded under, and never run by the server."""
    oa = client(tooled, tooled.key("oa-tools"))
    done = oa.chat.completions.create(
        model="agent", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required"
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"get_weather", "get_time"}
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in {"c", "f"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 40
    else:
        assert args == {}
    ids = (done.model_extra or {})["macaron"]
    events = tooled.events(ids["conversation_id"])
    [started] = [e.payload for e in events if isinstance(e.payload, ConversationStarted)]
    assert started.history[0].role == "system" and "get_weather" in started.history[0].content
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.decoding is not None and received.decoding.output == "json_schema"
    assert received.decoding.or_text is False
    assert not [e for e in events if isinstance(e.payload, HarnessActionExecuted)]
    named = oa.chat.completions.create(
        model="chat",
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [only] = named.choices[0].message.tool_calls or []
    assert only.function.name == "get_time"  # type: ignore[union-attr]


def test_auto_routes_a_request_with_tools_to_the_specialist_that_calls_them(
    tooled: Running, router: RouterService
) -> None:
    """``model: auto`` with ``tools``: a turn the classifier leans elsewhere on, but not clearly,
    goes to the agent (the harness's tool caller); a clearly other turn, or the same turn
    without tools (or with ``tool_choice`` none), is the classifier's. ``RouterDecided`` says
    why and what context it used."""
    oa = client(tooled, tooled.key("oa-tools-auto"))
    unclear, coding = (
        "Who won the world cup?",
        "Write a Scala function that counts the words in a string.",
    )
    assert router.route(unclear).specialist != "agent"

    def decided(**extra: Any) -> RouterDecided:
        done = oa.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": extra.pop("text")}], **extra
        )
        events = tooled.events((done.model_extra or {})["macaron"]["conversation_id"])
        [decision] = [e.payload for e in events if isinstance(e.payload, RouterDecided)]
        return decision

    tools = decided(text=unclear, tools=[WEATHER, CLOCK], max_tokens=48)
    assert (tools.specialist, tools.reason, tools.tool_callers) == (
        "agent",
        "client_tools",
        ["agent"],
    )
    assert max(tools.scores, key=lambda name: tools.scores[name]) != "agent"
    plain = decided(text=unclear, max_tokens=4)
    assert (plain.specialist, plain.reason, plain.tool_callers) == (
        router.route(unclear).specialist,
        "classifier",
        [],
    )
    assert plain.scores == pytest.approx(tools.scores)
    off = decided(text=unclear, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert (off.specialist, off.tool_callers) == (plain.specialist, [])
    clear = decided(text=coding, tools=[WEATHER], max_tokens=48)
    assert (clear.specialist, clear.reason, clear.tool_callers) == (
        "coding",
        "classifier",
        ["agent"],
    )


def test_a_tool_call_streams_as_one_delta_and_the_conversation_goes_on_with_its_result(
    tooled: Running,
) -> None:
    oa = client(tooled, tooled.key("oa-tools-stream"))
    chunks = list(
        oa.chat.completions.create(
            model="chat",
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta]
    [[streamed]] = [c for c in calls if c]
    assert streamed.index == 0 and streamed.function is not None
    assert streamed.function.name == "get_weather"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    follow_up: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": streamed.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": streamed.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": streamed.id, "content": "sunny, 21 C"},
    ]
    answer = oa.chat.completions.create(
        model="chat", messages=follow_up, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    events = tooled.events((answer.model_extra or {})["macaron"]["conversation_id"])
    [started] = [e.payload for e in events if isinstance(e.payload, ConversationStarted)]
    assert [m.role for m in started.history] == ["system", "user", "assistant"]
    assert json.loads(started.history[2].content)["tool"] == "get_weather"
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.content == "Tool result: sunny, 21 C"
    assert received.decoding is not None and received.decoding.output is None  # tool_choice none


def test_tool_choice_auto_with_the_async_client_answers_a_call_or_text(tooled: Running) -> None:
    """``auto``: a call or plain text, as the model likes (recorded as ``or_text``); whichever
    came, the response says it consistently."""

    async def ask() -> Any:
        async with openai.AsyncOpenAI(
            base_url=f"{tooled.http}/v1", api_key=tooled.key("oa-tools-async"), max_retries=0
        ) as oa:
            return await oa.chat.completions.create(model="agent", messages=ASK, tools=[WEATHER])

    done = asyncio.run(ask())
    choice = done.choices[0]
    events = tooled.events((done.model_extra or {})["macaron"]["conversation_id"])
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
    assert received.decoding is not None and received.decoding.or_text is True
    if choice.finish_reason == "tool_calls":
        [call] = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
    else:
        assert choice.message.tool_calls is None and choice.message.content is not None
        if choice.finish_reason == "stop":  # not cut at the limit: text, never a half call
            assert not choice.message.content.startswith("{")


def test_bad_tool_requests_are_typed_400s_and_record_nothing(tooled: Running) -> None:
    key = tooled.key("oa-tools-bad")
    before = len(tooled.events())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "required"}, "invalid_frame"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "invalid_frame",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "unsupported_parameter"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "invalid_frame"),
        ({"tools": [{"type": "retrieval"}]}, "invalid_frame"),
        (
            {"messages": [{"role": "tool", "content": None, "tool_call_id": "c"}]},
            "invalid_frame",
        ),
    ]
    for extra, code in cases:
        body = {"model": "chat", "messages": ASK, **extra}
        response = httpx.post(
            f"{tooled.http}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["code"] == code, extra
    assert len(tooled.events()) == before


def test_langchain_chat_openai_chats_streams_and_binds_tools(tooled: Running) -> None:
    """A popular framework client from PyPI (``langchain-openai``'s ``ChatOpenAI``) against the
    server: a reply, a stream, and a tool call it parses into its own ``tool_calls``."""
    llm = ChatOpenAI(
        base_url=f"{tooled.http}/v1",
        api_key=SecretStr(tooled.key("langchain")),
        model="chat",
        max_completion_tokens=8,
        max_retries=0,
    )
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.content, str)
    assert reply.response_metadata["model_name"] == "chat"
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] <= 8
    streamed = list(llm.stream("Say hello."))
    assert streamed and all(isinstance(chunk.content, str) for chunk in streamed)
    caller = llm.model_copy(update={"max_tokens": None}).bind_tools(
        [WEATHER], tool_choice="get_weather"
    )
    called = caller.invoke("Weather in Paris?")
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["unit"] in {"c", "f"}
