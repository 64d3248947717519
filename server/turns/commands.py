"""What a user asks of a completed turn, whichever front end it came through (a WebSocket
frame, an HTTP feedback body): the turn service's inbound commands, typed as its outbound side
streams typed items. The front ends validate; these carry what they validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from pydantic import JsonValue

FeedbackKind = Literal["up", "down", "edit", "regenerate"]


@dataclass(frozen=True)
class Feedback:
    """A verdict on a turn; ``edited_text`` goes with an ``edit`` alone."""

    turn_id: UUID
    kind: FeedbackKind
    edited_text: str | None = None


@dataclass(frozen=True)
class Reroute:
    """The specialist that should have answered a turn: recorded as a routing correction, and
    the turn's words answered again by that specialist."""

    turn_id: UUID
    specialist: str


@dataclass(frozen=True)
class UIEvent:
    """An interaction with a component a turn's GenUI tree rendered."""

    turn_id: UUID
    component_id: str
    action: str
    value: JsonValue = None
