"""Feedback over HTTP: what the WebSocket's ``feedback`` and ``reroute`` frames do, for clients
of the HTTP APIs, so OpenAI-API traffic teaches too. A chat completion's ``macaron`` block
names its conversation and turn; a turn lives in its conversation (the server rebuilds a
conversation from its own key in the log), so both are in the path.

- ``POST /v1/conversations/{conversation_id}/turns/{turn_id}/feedback`` with
  ``{"kind": "up"|"down"|"edit"|"regenerate", "edited_text"?}``: ``up``, ``down`` and ``edit``
  answer ``{"turn_id", "kind", "recorded": true}``; ``regenerate`` answers the same words again
  and returns that answer as a ``chat.completion``.
- ``POST /v1/conversations/{conversation_id}/turns/{turn_id}/reroute`` with
  ``{"specialist"}``: the routing correction, and that specialist's answer as a
  ``chat.completion``.
Tenant checks and errors are the WebSocket's: another tenant's conversation is not found.
"""

from __future__ import annotations

from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core.errors import ConversationNotFound, TurnNotFound
from server.chat import ChatService
from server.entrypoints.bodies import read_json
from server.entrypoints.openai_api import completion, principal_of
from server.entrypoints.protocol import MAX_CONTENT_CHARS, SpecialistName, Text
from server.turns.commands import Feedback, Reroute
from server.turns.feedback import regeneration


class FeedbackBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["up", "down", "edit", "regenerate"]
    edited_text: Text | None = Field(default=None, min_length=1, max_length=MAX_CONTENT_CHARS)


class RerouteBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    specialist: SpecialistName


def _ids(request: Request) -> tuple[UUID, UUID]:
    try:
        conversation_id = UUID(request.path_params["conversation_id"])
    except ValueError:
        raise ConversationNotFound("no such conversation") from None
    try:
        return conversation_id, UUID(request.path_params["turn_id"])
    except ValueError:
        raise TurnNotFound("no such turn") from None


async def feedback(request: Request) -> Response:
    service: ChatService = request.app.state.chat
    principal = await principal_of(request, request.app.state.gate)
    conversation_id, turn_id = _ids(request)
    body = await read_json(request, FeedbackBody)
    command = Feedback(turn_id, body.kind, body.edited_text)
    turn = await service.feedback(principal, conversation_id, command)
    if body.kind != "regenerate":
        return JSONResponse({"turn_id": str(turn_id), "kind": body.kind, "recorded": True})
    again = regeneration(turn, conversation_id)
    return JSONResponse(await completion(service, principal, again))


async def reroute(request: Request) -> Response:
    service: ChatService = request.app.state.chat
    principal = await principal_of(request, request.app.state.gate)
    conversation_id, turn_id = _ids(request)
    body = await read_json(request, RerouteBody)
    again = await service.reroute(principal, conversation_id, Reroute(turn_id, body.specialist))
    return JSONResponse(await completion(service, principal, again))
