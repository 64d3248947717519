"""The events of a conversation: a turn received, routed, acted on, answered and completed, and
the feedback and routing corrections a user gives on it."""

from __future__ import annotations

from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from core.events.envelope import EventPayload


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ConversationStarted(EventPayload):
    event_type = "ConversationStarted"
    private_fields = ("title", "history")
    conversation_id: UUID
    release_id: str
    title: str | None = None
    history: list[ChatMessage] = Field(default_factory=list)
    """Earlier messages a client brought with it (the OpenAI API sends them with each request),
    so the model's context can be rebuilt from the log alone."""


class HarnessStamp(BaseModel):
    """Which harness and HCP version produced a turn's event (part of the release, recorded on
    every event of the turn so an auditor needs no join)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    harness_version: str = Field(min_length=1, max_length=100)
    hcp_version: str = Field(min_length=1, max_length=100)


class RequestedDecoding(BaseModel):
    """How a client asked a turn to be decoded (the OpenAI API's parameters), over the
    specialist's harness settings; the server's ``max_new_tokens`` stays a cap. ``json``: any
    JSON value; ``json_schema``: a JSON value valid against ``json_schema`` (each enforced
    token by token, in place of the harness's grammar; a client's tool call is a
    ``json_schema`` output)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**62)
    stop: tuple[str, ...] = Field(default=(), max_length=4)
    output: Literal["json", "json_schema"] | None = None
    json_schema: dict[str, JsonValue] | None = None
    or_text: bool = False
    """With ``json_schema``: plain text is allowed instead (a client's ``tool_choice`` auto)."""

    @model_validator(mode="after")
    def _schema_for_its_output(self) -> RequestedDecoding:
        if (self.output == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required for output json_schema, and only for it")
        if self.or_text and self.output != "json_schema":
            raise ValueError("or_text goes with output json_schema")
        return self


FrontEnd = Literal["chat", "openai"]
"""Where a turn's words came in: the chat protocol (a person at a chat client: the WebSocket or
its HTTP twin; regenerations, reroutes and GenUI events too) or the OpenAI API (a program, whose
``model`` field may be fixed in its code)."""


class TurnReceived(EventPayload):
    """v2 renamed ``text`` to ``content`` and added ``client_msg_id`` and ``specialist_hint``;
    v3 added the serving release, the harness stamp (``None`` on turns upcast from before the
    harness existed) and ``input_kind`` (a typed message, or a GenUI ``ui_event``); v4 added
    ``regenerates``, the turn this one answers again (the user asked to regenerate it); v5
    added ``decoding``, what the client asked of the decoding (``None``: the harness's); v6
    added ``decoding.or_text`` (a client's tool call, or text); v7 added ``front_end``, where
    the words came in (``None`` on turns upcast from before)."""

    event_type = "TurnReceived"
    schema_version = 7
    private_fields = ("content", "client_msg_id", "decoding")
    conversation_id: UUID
    turn_id: UUID
    client_msg_id: str = Field(min_length=1, max_length=200)
    content: str
    specialist_hint: str | None = None
    input_kind: Literal["text", "ui_event"] = "text"
    release_id: str | None
    harness: HarnessStamp | None
    regenerates: UUID | None = None
    decoding: RequestedDecoding | None = None
    front_end: FrontEnd | None = None


RoutingReason = Literal["classifier", "hint", "only_specialist", "client_tools", "follow_up"]
"""Why the router chose a specialist (``core.routing.decide``)."""


class RouterDecided(EventPayload):
    """v2 added why (``reason``: ``None`` on decisions upcast from v1, which did not record it)
    and the context the decision used: the specialists that call tools, when the request
    carried client tools (``tool_callers``), and the specialist of the conversation's previous
    turn, when the message was a short follow-up (``previous``), so a replay decides the
    same."""

    event_type = "RouterDecided"
    schema_version = 2
    turn_id: UUID
    scores: dict[str, float]
    specialist: str
    adapter_version: str
    router_version: str
    harness: HarnessStamp
    reason: RoutingReason | None = None
    tool_callers: list[str] = Field(default_factory=list)
    previous: str | None = None


class HarnessActionExecuted(EventPayload):
    event_type = "HarnessActionExecuted"
    private_fields = ("args", "result", "state_delta")
    turn_id: UUID
    action_id: UUID
    name: str
    args: dict[str, JsonValue]
    result: JsonValue
    ok: bool
    state_delta: dict[str, JsonValue] = Field(default_factory=dict)
    harness: HarnessStamp


class GenUIRendered(EventPayload):
    event_type = "GenUIRendered"
    private_fields = ("tree", "errors")
    turn_id: UUID
    tree: dict[str, JsonValue]
    valid: bool
    errors: list[str] = Field(default_factory=list)
    catalogue_version: str
    harness: HarnessStamp


class ModelResponded(EventPayload):
    event_type = "ModelResponded"
    private_fields = ("text",)
    turn_id: UUID
    release_id: str
    specialist: str
    adapter_version: str
    harness: HarnessStamp
    text: str
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class TurnCompleted(EventPayload):
    event_type = "TurnCompleted"
    turn_id: UUID
    latency_ms: float = Field(ge=0)
    time_to_first_token_ms: float | None = Field(default=None, ge=0)
    harness: HarnessStamp


class FeedbackGiven(EventPayload):
    event_type = "FeedbackGiven"
    private_fields = ("edited_text",)
    turn_id: UUID
    kind: Literal["up", "down", "edit", "regenerate"]
    edited_text: str | None = None


class RoutingCorrected(EventPayload):
    """A user saying which specialist should have answered a completed turn (a ``reroute``;
    the turn is then answered again by that specialist)."""

    event_type = "RoutingCorrected"
    turn_id: UUID
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
