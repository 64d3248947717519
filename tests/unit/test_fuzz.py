"""Property-based fuzzing of the two decoders that take untrusted bytes: the WebSocket frame
parser and the event-log decoder. Whatever comes in, the answer is a value or a typed error,
never another exception; what parses can be stored."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core.errors import InvalidFrame
from core.events import ConversationStarted, NewEvent
from core.log import DeadLetter, LogPosition, RecordedEvent
from core.mapper import Mapper
from server.entrypoints import protocol

pytestmark = pytest.mark.badinput

FRAME_TYPES = ["hello", "user_turn", "feedback", "ui_event", "cancel", "ping"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(
    [
        "type",
        "client_msg_id",
        "content",
        "conversation_id",
        "turn_id",
        "kind",
        "edited_text",
        "specialist_hint",
        "component_id",
        "action",
        "value",
        "api_key",
    ]
) | st.text(max_size=12)
frame_like = st.fixed_dictionaries(
    {"type": st.sampled_from(FRAME_TYPES) | st.text(max_size=10)},
    optional={
        "client_msg_id": st.text(max_size=30),
        "content": st.text(max_size=50),
        "turn_id": st.uuids().map(str) | st.text(max_size=40),
        "kind": st.sampled_from(["up", "down", "edit", "regenerate"]) | st.text(),
        "edited_text": st.text(max_size=50),
        "value": json_values,
    },
).flatmap(
    lambda base: st.dictionaries(field_names, json_values, max_size=3).map(
        lambda extra: {**extra, **base}
    )
)


def _parses_or_refuses(text: str) -> None:
    try:
        frame = protocol.parse_client_frame(text)
    except InvalidFrame as exc:
        assert exc.message  # a reason the client can read
        return
    # what parses can be stored: every string encodes and none holds a NUL
    dumped = frame.model_dump_json()
    dumped.encode("utf-8")
    assert "\\u0000" not in dumped


@given(st.text())
@example("[" * 100_000)
@example('{"type": "ui_event", "value": ' + "[" * 50_000 + "]" * 50_000 + "}")
@example('{"type": "user_turn", "client_msg_id": "a", "content": "x\\u0000y"}')
@example('{"type": "user_turn", "client_msg_id": "a", "content": "\\ud800"}')
@example('{"type": "ping"}\x00')
def test_any_text_is_a_frame_or_invalid_frame(text: str) -> None:
    _parses_or_refuses(text)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(frame_like)
def test_frame_shaped_json_is_a_frame_or_invalid_frame(frame: dict[str, Any]) -> None:
    _parses_or_refuses(json.dumps(frame))


def _stored() -> dict[str, Any]:
    """A real sealed envelope, as the log stores it."""
    conversation = uuid.uuid4()
    event = NewEvent(
        payload=ConversationStarted(conversation_id=conversation, release_id="r"),
        tenant_id="acme",
        key=str(conversation),
    )
    data: dict[str, Any] = json.loads(Mapper().seal(event, 1, None).envelope_json())
    return data


STORED = _stored()
AT = LogPosition(0, 7)


def _decodes_or_dead_letters(raw: bytes | str | dict[str, Any] | None) -> None:
    decoded = Mapper().decode_stored(AT, raw)
    assert isinstance(decoded, RecordedEvent | DeadLetter)
    if isinstance(decoded, DeadLetter):
        assert decoded.position == AT and decoded.code and decoded.reason


def test_a_real_envelope_decodes() -> None:
    assert isinstance(Mapper().decode_stored(AT, json.dumps(STORED)), RecordedEvent)


@given(st.binary() | st.text() | st.none())
@example(b"[" * 100_000)
@example(b"\xff\xfe\x00")
def test_any_stored_bytes_decode_or_become_a_dead_letter(raw: bytes | str | None) -> None:
    _decodes_or_dead_letters(raw)


@given(st.sampled_from(sorted(STORED)), json_values)
def test_an_envelope_with_any_field_replaced_decodes_or_becomes_a_dead_letter(
    field: str, value: Any
) -> None:
    _decodes_or_dead_letters({**STORED, field: value})


@given(st.dictionaries(st.text(max_size=20), json_values, max_size=6))
def test_any_payload_decodes_or_becomes_a_dead_letter(payload: dict[str, Any]) -> None:
    _decodes_or_dead_letters({**STORED, "payload": payload})
