"""What the turn service streams while it answers a turn, whichever front end listens: each
front end turns these items into its own wire format (``server.entrypoints.ws`` into protocol
v1 frames, ``server.entrypoints.openai_api`` into OpenAI chunks)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from uuid import UUID

from pydantic import JsonValue


@dataclass(frozen=True)
class TurnStarted:
    """The turn is under way: who answers it, with which adapter, in which release."""

    turn_id: UUID
    conversation_id: UUID
    client_msg_id: str
    specialist: str
    adapter_version: str
    release_id: str


@dataclass(frozen=True)
class TextDelta:
    """More of the answer's text."""

    turn_id: UUID
    delta: str


@dataclass(frozen=True)
class GenUITree:
    """The answer as a valid GenUI tree, shown whole."""

    turn_id: UUID
    tree: dict[str, JsonValue]


@dataclass(frozen=True)
class ActionDone:
    """A tool the model called, run and recorded."""

    turn_id: UUID
    name: str
    args: dict[str, JsonValue]
    result: JsonValue
    ok: bool


@dataclass(frozen=True)
class TurnEnded:
    """The turn is durable; ``resent`` when it was answered before (a repeated
    ``client_msg_id``)."""

    turn_id: UUID
    latency_ms: float
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    resent: bool = False


TurnItem = TurnStarted | TextDelta | GenUITree | ActionDone | TurnEnded

Sink = Callable[[TurnItem], Awaitable[None]]
"""Where a turn's items go: the WebSocket, or an OpenAI API response."""
