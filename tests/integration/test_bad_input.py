"""The bad-input corpus (``tests/data/bad-input.jsonl``) against a real server.

Each case is one WebSocket frame (on a fresh, authenticated connection) or one HTTP request,
with the answer it must get: a typed error (and the connection goes on), or the documented
close code (1007 invalid UTF-8, 1009 over the frame limit). Nothing a case sends may be stored,
and the server stays healthy. ``⟦x*N⟧`` in a case stands for ``x`` repeated N times.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from infra.local_stack import LocalStack
from server.router import RouterService
from tests.serving import Running, frames_until, send, serving

pytestmark = pytest.mark.badinput

CORPUS = Path(__file__).resolve().parents[1] / "data" / "bad-input.jsonl"
CASES: list[dict[str, Any]] = [json.loads(line) for line in CORPUS.read_text().splitlines()]
TENANT = "corpus"
_REPEAT = re.compile(r"⟦(.+?)\*(\d+)⟧")


def expand(text: str) -> str:
    return _REPEAT.sub(lambda m: m[1] * int(m[2]), text)


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
        max_new_tokens=8,
        turns_per_minute=100_000,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def keys(served: Running) -> dict[str, str]:
    return {"chat": served.key(TENANT), "admin": served.key(TENANT, "admin")}


def test_the_corpus_is_large_and_every_case_says_what_it_expects() -> None:
    assert len(CASES) >= 200
    assert len({c["id"] for c in CASES}) == len(CASES)
    for case in CASES:
        assert case["channel"] in {"ws", "http"} and case["expect"], case["id"]


def _cases(channel: str) -> list[dict[str, Any]]:
    return [case for case in CASES if case["channel"] == channel]


@pytest.mark.parametrize("case", _cases("ws"), ids=lambda c: c["id"])
def test_a_bad_frame_gets_a_typed_error_or_its_close_code(
    served: Running, keys: dict[str, str], case: dict[str, Any]
) -> None:
    with served.connect(keys["chat"]) as ws:
        frames_until(ws, "ready")
        if "frame" in case:
            ws.send(expand(case["frame"]))
        elif "binary_b64" in case:
            ws.send(base64.b64decode(case["binary_b64"]))
        else:
            ws.send(base64.b64decode(case["text_b64"]), text=True)
        expect = case["expect"]
        if "close" in expect:
            with pytest.raises(ConnectionClosed) as closed:
                frames_until(ws, "error", timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == expect["close"]
            return
        error = frames_until(ws, "error", timeout=10)[-1]
        assert error["code"] == expect["code"], error
        assert error["message"] and error["retryable"] is False
        send(ws, type="ping")  # the connection goes on
        assert frames_until(ws, "pong", timeout=10)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c["channel"] == "http"], ids=lambda c: c["id"]
)
def test_a_bad_request_gets_its_status_and_a_typed_error(
    served: Running, keys: dict[str, str], case: dict[str, Any]
) -> None:
    if "body_b64" in case:
        body: bytes | None = base64.b64decode(case["body_b64"])
    else:
        body = None if case.get("body") is None else expand(case["body"]).encode()
    response = httpx.request(
        case["method"],
        served.http + case["path"],
        content=body,
        timeout=30,
        headers={
            "Authorization": f"Bearer {keys[case['key']]}",
            "Content-Type": "application/json",
        },
    )
    expect = case["expect"]
    assert response.status_code == expect["status"], response.text[:500]
    error = response.json()["error"]
    assert error["code"] == expect["code"] and error["message"]


def test_the_corpus_stored_nothing_and_the_server_is_healthy(
    served: Running, keys: dict[str, str]
) -> None:
    assert not [e for e in served.events() if e.envelope.tenant_id == TENANT]
    with served.connect(keys["chat"]) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="after", content="Still there?")
        assert frames_until(ws, "turn_completed")[-1]["type"] == "turn_completed"
    assert [e for e in served.events() if e.envelope.tenant_id == TENANT]


def test_twenty_invalid_frames_close_the_connection_with_1008(
    served: Running, keys: dict[str, str]
) -> None:
    with served.connect(keys["chat"]) as ws:
        frames_until(ws, "ready")
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(21):
                ws.send("{")
                frames_until(ws, "error", timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
