"""The OpenAI-compatible API: ``POST /v1/chat/completions`` (streamed or not) and
``GET /v1/models``, over the same chat service, auth and events as the WebSocket.

Each request is a new conversation: the messages before the last user message are recorded in
``ConversationStarted`` as its history, so the context stays rebuildable from the log.
``model`` is ``auto`` (the router decides) or a specialist name (a hint the router honours).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Any
from uuid import UUID

from opentelemetry.trace import Span
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core.auth import Principal, bearer_key
from core.errors import InvalidFrame, MacaronError
from core.events import ChatMessage
from core.ids import uuid7
from core.routing import UnknownSpecialist
from infra import observe
from server.chat import ChatService
from server.entrypoints.bodies import read_json
from server.entrypoints.gate import Gate
from server.entrypoints.openai_request import ChatCompletionRequest
from server.entrypoints.openai_tools import ToolDef, answer_message, described
from server.turns.items import GenUITree, TextDelta, TurnEnded, TurnItem, TurnStarted
from server.turns.request import TurnOutcome, TurnRequest

AUTO = "auto"


async def principal_of(request: Request, gate: Gate) -> Principal:
    return await gate.authenticate(bearer_key(request.headers.get("authorization")), "chat")


def _turn_request(body: ChatCompletionRequest, service: ChatService) -> TurnRequest:
    *earlier, last = body.messages
    if last.role not in ("user", "tool") or not last.text:
        raise InvalidFrame("messages must end with a non-empty user (or tool) message")
    hint = None
    if body.model != AUTO:
        if body.model not in service.release.adapters:
            raise UnknownSpecialist(f"no model {body.model!r}: use auto or a specialist name")
        hint = body.model
    return TurnRequest(
        client_msg_id=f"openai-{uuid7()}",
        content=last.text,
        specialist_hint=hint,
        history=(
            *([described(body.tools)] if body.tools else []),
            *(ChatMessage(role=m.chat_role, content=m.text) for m in earlier),
        ),
        decoding=body.decoding(),
        front_end="openai",
        client_tools=bool(body.callable_tools()),
    )


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _content(outcome: TurnOutcome, shown: list[TurnItem]) -> str:
    """What the user got: streamed text, or the GenUI tree as JSON."""
    for item in shown:
        if isinstance(item, GenUITree):
            return json.dumps(item.tree)
    return "".join(i.delta for i in shown if isinstance(i, TextDelta)) or outcome.text


async def chat_completions(request: Request) -> Response:
    service: ChatService = request.app.state.chat
    principal = await principal_of(request, request.app.state.gate)
    body = await read_json(request, ChatCompletionRequest)
    turn = _turn_request(body, service)
    await service.check_output(turn.decoding)
    if body.stream:
        return StreamingResponse(
            _stream(service, principal, turn, body), media_type="text/event-stream"
        )
    return JSONResponse(await completion(service, principal, turn, body.callable_tools()))


async def completion(
    service: ChatService,
    principal: Principal,
    turn: TurnRequest,
    tools: list[ToolDef] | None = None,
) -> dict[str, Any]:
    """Answer ``turn`` whole, as an OpenAI ``chat.completion`` object (with the ids and
    versions that served it under ``macaron``)."""
    shown: list[TurnItem] = []

    async def collect(item: TurnItem) -> None:
        shown.append(item)

    with _span(principal):
        outcome = await service.run_turn(principal, turn, collect, asyncio.Event())
    started = next(i for i in shown if isinstance(i, TurnStarted))
    message, called = answer_message(_content(outcome, shown), tools, _call_id(outcome.turn_id))
    return {
        "id": f"chatcmpl-{outcome.turn_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": started.specialist,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": called or _finish(outcome.finish_reason),
            }
        ],
        "usage": _usage(outcome.prompt_tokens, outcome.completion_tokens),
        "macaron": _provenance(started),
    }


def _call_id(turn_id: UUID) -> str:
    return f"call_{turn_id.hex}"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _provenance(started: TurnStarted) -> dict[str, str]:
    return {
        "turn_id": str(started.turn_id),
        "conversation_id": str(started.conversation_id),
        "specialist": started.specialist,
        "adapter_version": started.adapter_version,
        "release_id": started.release_id,
    }


def _span(principal: Principal) -> AbstractContextManager[Span]:
    """The root span of a turn over HTTP (``ws.turn``'s twin)."""
    return observe.tracer.start_as_current_span(
        "http.chat_completion", attributes={"macaron.tenant_id": principal.tenant_id}
    )


async def _stream(
    service: ChatService, principal: Principal, turn: TurnRequest, body: ChatCompletionRequest
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; the last chunk comes only once the turn is
    durable. A client that goes away does not stop the turn from being recorded. With
    ``tools``, the answer comes whole before the last chunk: a call, or text."""
    queue: asyncio.Queue[TurnItem | MacaronError | None] = asyncio.Queue()
    answered: list[TurnOutcome] = []

    async def run() -> None:
        try:
            with _span(principal):
                answered.append(await service.run_turn(principal, turn, queue.put, asyncio.Event()))
        except MacaronError as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    base: dict[str, Any] = {"object": "chat.completion.chunk", "created": int(time.time())}
    completed: TurnEnded | None = None
    tools = body.callable_tools()
    while (item := await queue.get()) is not None:
        match item:
            case TurnStarted():
                base |= {
                    "id": f"chatcmpl-{item.turn_id}",
                    "model": item.specialist,
                    "macaron": _provenance(item),
                }
                yield _event(base, {"role": "assistant", "content": ""}, None)
            case TextDelta() | GenUITree() if tools:
                pass  # the answer comes whole, once it is known to be a call or not
            case TextDelta():
                yield _event(base, {"content": item.delta}, None)
            case GenUITree():
                yield _event(base, {"content": json.dumps(item.tree)}, None)
            case TurnEnded() if tools:
                completed = item
            case TurnEnded():
                yield _last(base, item, body, None)
            case MacaronError():
                yield _error_event(item)
    await task
    if completed is not None and answered:
        outcome = answered[0]
        message, called = answer_message(outcome.text, tools, _call_id(outcome.turn_id))
        delta = {"content": message["content"]}
        if called:
            delta = {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}
        yield _event(base, delta, None)
        yield _last(base, completed, body, called)
    yield "data: [DONE]\n\n"


def _error_event(exc: MacaronError) -> str:
    error = {"code": exc.code, "message": exc.message, "type": exc.code, "retryable": exc.retryable}
    return f"data: {json.dumps({'error': error})}\n\n"


def _last(
    base: dict[str, Any],
    ended: TurnEnded,
    body: ChatCompletionRequest,
    called: str | None,
) -> str:
    """The finish chunk and, when asked (``include_usage``), the usage in a chunk of its own
    with no choices, as the API sends it."""
    last = _event(base, {}, called or _finish(ended.finish_reason))
    if body.stream_options is not None and body.stream_options.include_usage:
        usage = _usage(ended.prompt_tokens, ended.completion_tokens)
        last += f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
    return last


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _event(base: dict[str, Any], delta: dict[str, Any], finish: str | None) -> str:
    return f"data: {json.dumps(_chunk(base, delta, finish))}\n\n"


async def models(request: Request) -> Response:
    """``GET /v1/models``: ``auto`` and each specialist a turn may go to (enabled in the
    active release)."""
    await principal_of(request, request.app.state.gate)
    return JSONResponse({"object": "list", "data": _models(request.app.state.chat)})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one of them."""
    await principal_of(request, request.app.state.gate)
    wanted = request.path_params["model_id"]
    for found in _models(request.app.state.chat):
        if found["id"] == wanted:
            return JSONResponse(found)
    raise UnknownSpecialist(f"no model {wanted!r}: use auto or a specialist name")


def _models(service: ChatService) -> list[dict[str, Any]]:
    release, enabled = service.release, service.specialists
    created = int(time.time())
    data: list[dict[str, Any]] = [
        {
            "id": AUTO,
            "object": "model",
            "created": created,
            "owned_by": "macaron",
            "release_id": release.release_id,
        }
    ]
    data += [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "macaron",
            "adapter_version": adapter.name,
            "adapter_sha256": adapter.sha256,
            "release_id": release.release_id,
        }
        for name, adapter in sorted(release.adapters.items())
        if name in enabled
    ]
    return data
