"""What users say about completed turns: feedback (up, down, edit, regenerate), routing
corrections (``reroute``) and GenUI interactions; a reroute and an interaction become turns of
their own."""

from __future__ import annotations

import json
from uuid import UUID

from pydantic import JsonValue

from core.auth import Principal
from core.conversation import Conversation, Turn
from core.errors import InvalidFrame, TurnNotFound
from core.events import FeedbackGiven, RoutingCorrected
from core.harness.genui import interactive_ids
from core.ids import uuid7
from core.routing import UnknownSpecialist
from infra import observe
from server import protocol as wire
from server.turns.conversations import ConversationStore
from server.turns.request import TurnRequest


def regeneration(
    turn: Turn, conversation_id: UUID | None, specialist: str | None = None
) -> TurnRequest:
    """The turn that answers ``turn``'s words again, with the decoding its client asked for:
    by its own specialist (a ``regenerate``) or by ``specialist`` (a ``reroute``)."""
    return TurnRequest(
        client_msg_id=f"{'regenerate' if specialist is None else 'reroute'}-{uuid7()}",
        content=turn.content,
        conversation_id=conversation_id,
        specialist_hint=turn.specialist if specialist is None else specialist,
        regenerates=turn.turn_id,
        decoding=turn.decoding,
    )


class TurnFeedback:
    def __init__(self, store: ConversationStore) -> None:
        self._store = store

    async def feedback(
        self, principal: Principal, conversation_id: UUID | None, frame: wire.Feedback
    ) -> Turn:
        """Record feedback on a completed turn of this tenant's conversation."""
        conversation, turn = await self._completed(principal, conversation_id, frame.turn_id)
        if frame.kind == "edit" and frame.edited_text is None:
            raise InvalidFrame("feedback of kind edit needs edited_text")
        if frame.kind != "edit" and frame.edited_text is not None:
            raise InvalidFrame("edited_text goes only with feedback of kind edit")
        payload = FeedbackGiven(
            turn_id=turn.turn_id, kind=frame.kind, edited_text=frame.edited_text
        )
        # Feedback continues the turn's trace: what it teaches is followed from the turn.
        with observe.tracer.start_as_current_span(
            "ws.feedback",
            context=observe.context_of(turn.trace),
            attributes={"macaron.turn_id": str(turn.turn_id), "macaron.feedback": frame.kind},
        ):
            await self._store.append(conversation, [payload], correlation_id=turn.turn_id)
        return turn

    async def reroute(
        self,
        principal: Principal,
        conversation_id: UUID | None,
        frame: wire.Reroute,
        active: frozenset[str],
    ) -> TurnRequest:
        """Record that ``frame.specialist`` should have answered a completed turn, and the
        turn that answers its words again with that specialist."""
        conversation, turn = await self._completed(principal, conversation_id, frame.turn_id)
        if frame.specialist not in active:
            raise UnknownSpecialist(
                f"no active specialist {frame.specialist!r}: choose one of {sorted(active)}"
            )
        if frame.specialist == turn.specialist:
            raise InvalidFrame(f"turn {turn.turn_id} was answered by {turn.specialist} already")
        if turn.input_kind != "text":
            raise InvalidFrame("only a typed message can be rerouted")
        payload = RoutingCorrected(turn_id=turn.turn_id, specialist=frame.specialist)
        with observe.tracer.start_as_current_span(
            "ws.reroute",
            context=observe.context_of(turn.trace),
            attributes={
                "macaron.turn_id": str(turn.turn_id),
                "macaron.specialist": frame.specialist,
            },
        ):
            await self._store.append(conversation, [payload], correlation_id=turn.turn_id)
        return regeneration(turn, conversation_id, frame.specialist)

    async def ui_event_turn(
        self, principal: Principal, conversation_id: UUID | None, frame: wire.UIEvent
    ) -> TurnRequest:
        """The harness input a GenUI interaction becomes: a turn of kind ``ui_event``."""
        _, turn = await self._completed(principal, conversation_id, frame.turn_id)
        tree = turn.genui.tree if turn.genui is not None and turn.genui.valid else None
        if tree is None or frame.component_id not in interactive_ids(tree):
            raise InvalidFrame(f"turn {frame.turn_id} rendered no component {frame.component_id!r}")
        event: dict[str, JsonValue] = {
            "turn_id": str(frame.turn_id),
            "component_id": frame.component_id,
            "action": frame.action,
            "value": frame.value,
        }
        return TurnRequest(
            client_msg_id=f"ui-{uuid7()}",
            content="ui_event " + json.dumps(event),
            conversation_id=conversation_id,
            specialist_hint=turn.specialist,
            input_kind="ui_event",
        )

    async def _completed(
        self, principal: Principal, conversation_id: UUID | None, turn_id: UUID
    ) -> tuple[Conversation, Turn]:
        if conversation_id is None:
            raise TurnNotFound(f"no turn {turn_id}: start or resume a conversation first")
        conversation = await self._store.get(principal, conversation_id)
        turn = conversation.turns.get(turn_id)
        if turn is None or turn.completed is None:
            raise TurnNotFound(f"no completed turn {turn_id} in conversation {conversation_id}")
        return conversation, turn
