"""The OpenAI-compatible API, driven by the official ``openai`` client against a real server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from core.events import ConversationStarted, ModelResponded, TurnReceived
from infra.local_stack import LocalStack
from server.router import RouterService
from tests.serving import Running, serving


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


def client(served: Running, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=key, max_retries=0)


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
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    extra = chunks[0].model_extra or {}
    events = served.events(extra["macaron"]["conversation_id"])
    [received] = [e.payload for e in events if isinstance(e.payload, TurnReceived)]
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
