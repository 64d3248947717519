"""One streamed completion from one vLLM replica, as ``GenerationChunk``s; any way the replica
fails before the finish reason is ``ReplicaLost``."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from core.engine import FinishReason, GenerationChunk, GenerationRequest
from core.errors import EngineUnavailable
from engines.vllm.errors import ReplicaLost, error_info, refusal

FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}
DATA = "data: "


def parse_event(data: str, url: str) -> tuple[str, tuple[int, ...], FinishReason | None]:
    """One server-sent event of a streamed completion: (text, token ids, finish reason)."""
    try:
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            raise refusal(
                int(error.get("code") or 500),
                str(error.get("type")),
                str(error.get("message")),
                url,
            )
        choice = event["choices"][0]
        tokens = tuple(int(t) for t in choice.get("token_ids") or ())
        finish = choice.get("finish_reason")
        return (
            str(choice["text"]),
            tokens,
            None if finish is None else FINISH.get(finish, "cancelled"),
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ReplicaLost(f"a malformed event in the stream ({exc!r})") from exc


def completion_body(
    request: GenerationRequest, prompt: list[int], structured: dict[str, str] | None = None
) -> dict[str, Any]:
    """The ``/v1/completions`` request for ``request`` on its adapter, streamed with token ids;
    ``structured`` (a checked constraint's schema, or its grammar as EBNF) is vLLM's
    ``structured_outputs``, and the answer then ends when it is complete (EOS is not ignored)."""
    params = request.params
    body: dict[str, Any] = {
        "model": request.adapter,
        "prompt": prompt,
        "stream": True,
        "return_token_ids": True,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "ignore_eos": params.ignore_eos and structured is None,
        "stop": list(params.stop),
    }
    if structured is not None:
        body["structured_outputs"] = structured
    if params.seed is not None:
        body["seed"] = params.seed
    return body


async def stream_completion(
    url: str,
    request: GenerationRequest,
    prompt: list[int],
    *,
    timeout: httpx.Timeout,
    stopping: threading.Event,
    structured: dict[str, str] | None = None,
) -> AsyncGenerator[GenerationChunk, None]:
    """Stream ``request`` from the replica at ``url`` until its finish reason; a set
    ``stopping`` (the engine shut down) ends it with ``EngineUnavailable``."""
    completion = 0
    try:
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            client.stream(
                "POST", f"{url}/v1/completions", json=completion_body(request, prompt, structured)
            ) as response,
        ):
            if response.status_code != 200:
                kind, message = error_info(await response.aread())
                raise refusal(response.status_code, kind, message, url)
            async for line in response.aiter_lines():
                if stopping.is_set():
                    raise EngineUnavailable("the engine was shut down")
                if not line.startswith(DATA) or line == f"{DATA}[DONE]":
                    continue
                text, tokens, finish = parse_event(line[len(DATA) :], url)
                completion += len(tokens)
                yield GenerationChunk(
                    request_id=request.request_id,
                    text=text,
                    token_ids=tokens,
                    finish_reason=finish,
                    prompt_tokens=len(prompt),
                    completion_tokens=completion,
                )
                if finish is not None:
                    return
    except httpx.HTTPError as exc:  # refused, reset, timed out, cut short, undecodable
        raise ReplicaLost(f"{exc.__class__.__name__}: {exc}") from exc
    raise ReplicaLost("the stream ended without a finish reason")
