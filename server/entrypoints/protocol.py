"""WebSocket chat protocol v1: every frame either side may send, as pydantic models.

Frames are JSON text objects with a ``type``. ``parse_client_frame`` is the one way in: anything
that is not a valid client frame raises ``InvalidFrame`` with the path-level reasons, and the
connection answers with an ``error`` frame (see docs/protocol.md for the connection policy).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
)

from core.errors import InvalidFrame, MacaronError
from server.turns import commands

PROTOCOL_VERSION = 1
MAX_CONTENT_CHARS = 16_000
"""Longest ``user_turn`` content accepted (characters)."""


def storable(text: str) -> str:
    """Text that every event log can store and every reader can decode: valid Unicode (no lone
    surrogates) and no NUL characters (PostgreSQL's JSON refuses them)."""
    if "\x00" in text:
        raise ValueError("must not contain NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return text


def _storable_json(value: JsonValue) -> JsonValue:
    """``storable`` for every string (keys included) of a JSON value."""
    if isinstance(value, str):
        storable(value)
    elif isinstance(value, list):
        for item in value:
            _storable_json(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            storable(key)
            _storable_json(item)
    return value


Text = Annotated[str, AfterValidator(storable)]
StorableJson = Annotated[JsonValue, AfterValidator(_storable_json)]
ClientMsgId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")]
SpecialistName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")]


class Frame(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# --- client -> server ---------------------------------------------------------------------


class Hello(Frame):
    """Authenticates (when the upgrade carried no ``Authorization`` header) and may resume a
    conversation."""

    type: Literal["hello"]
    api_key: str | None = Field(default=None, max_length=200)
    conversation_id: UUID | None = None


class UserTurn(Frame):
    type: Literal["user_turn"]
    conversation_id: UUID | None = None
    client_msg_id: ClientMsgId
    content: Text = Field(min_length=1, max_length=MAX_CONTENT_CHARS)
    specialist_hint: SpecialistName | None = None


class Feedback(Frame):
    type: Literal["feedback"]
    turn_id: UUID
    kind: Literal["up", "down", "edit", "regenerate"]
    edited_text: Text | None = Field(default=None, min_length=1, max_length=MAX_CONTENT_CHARS)

    def command(self) -> commands.Feedback:
        return commands.Feedback(self.turn_id, self.kind, self.edited_text)


class Reroute(Frame):
    """The specialist that should have answered a completed turn: recorded as a routing
    correction, and the turn's words are answered again by that specialist."""

    type: Literal["reroute"]
    turn_id: UUID
    specialist: SpecialistName

    def command(self) -> commands.Reroute:
        return commands.Reroute(self.turn_id, self.specialist)


class UIEvent(Frame):
    type: Literal["ui_event"]
    turn_id: UUID
    component_id: Text = Field(min_length=1, max_length=100)
    action: Text = Field(min_length=1, max_length=100)
    value: StorableJson = None

    def command(self) -> commands.UIEvent:
        return commands.UIEvent(self.turn_id, self.component_id, self.action, self.value)


class Cancel(Frame):
    type: Literal["cancel"]
    turn_id: UUID


class Ping(Frame):
    type: Literal["ping"]


ClientFrame = Annotated[
    Hello | UserTurn | Feedback | Reroute | UIEvent | Cancel | Ping, Field(discriminator="type")
]
_CLIENT: TypeAdapter[ClientFrame] = TypeAdapter(ClientFrame)


# --- server -> client ---------------------------------------------------------------------


class Ready(Frame):
    type: Literal["ready"] = "ready"
    protocol_version: int = PROTOCOL_VERSION
    conversation_id: UUID | None = None
    release_id: str
    tenant_id: str
    specialists: list[str]  # those a turn may go to (a hint may name), in the router's order


class TurnStarted(Frame):
    type: Literal["turn_started"] = "turn_started"
    turn_id: UUID
    conversation_id: UUID
    client_msg_id: str
    specialist: str
    adapter_version: str
    release_id: str


class Token(Frame):
    type: Literal["token"] = "token"
    turn_id: UUID
    delta: str


class Action(Frame):
    type: Literal["action"] = "action"
    turn_id: UUID
    name: str
    args: dict[str, JsonValue]
    result: JsonValue
    ok: bool


class GenUI(Frame):
    type: Literal["genui"] = "genui"
    turn_id: UUID
    tree: dict[str, JsonValue]


class Usage(Frame):
    prompt_tokens: int
    completion_tokens: int


class TurnCompleted(Frame):
    """``resent`` is true when the turn was answered before (a repeated ``client_msg_id``)."""

    type: Literal["turn_completed"] = "turn_completed"
    turn_id: UUID
    usage: Usage
    latency_ms: float
    finish_reason: str
    resent: bool = False


class Error(Frame):
    type: Literal["error"] = "error"
    code: str
    message: str
    retryable: bool
    turn_id: UUID | None = None

    @classmethod
    def of(cls, exc: MacaronError, turn_id: UUID | None = None) -> Error:
        return cls(code=exc.code, message=exc.message, retryable=exc.retryable, turn_id=turn_id)


class Pong(Frame):
    type: Literal["pong"] = "pong"


ServerFrame = Annotated[
    Ready | TurnStarted | Token | Action | GenUI | TurnCompleted | Error | Pong,
    Field(discriminator="type"),
]


def parse_client_frame(text: str) -> ClientFrame:
    """Decode one text frame; ``InvalidFrame`` says what is wrong, field by field."""
    try:
        data: Any = json.loads(text)
    except ValueError as exc:
        raise InvalidFrame(f"frame is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidFrame("frame is nested too deeply") from exc
    if not isinstance(data, dict):
        raise InvalidFrame("frame must be a JSON object with a type")
    try:
        return _CLIENT.validate_python(data)
    except ValidationError as exc:
        raise InvalidFrame("; ".join(_describe(e) for e in exc.errors()[:10])) from exc
    except RecursionError as exc:
        raise InvalidFrame("frame is nested too deeply") from exc


def _describe(error: Any) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "frame"
    return f"{path}: {error['msg']}"


def json_schema() -> dict[str, Any]:
    """JSON Schema of protocol v1: both directions, for docs/protocol.md and clients."""
    client = _CLIENT.json_schema()
    server = TypeAdapter(ServerFrame).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Macaron WebSocket protocol v{PROTOCOL_VERSION}",
        "$defs": {**client.pop("$defs", {}), **server.pop("$defs", {})},
        "properties": {"client": client, "server": server},
    }
