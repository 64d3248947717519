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
from server.turns.commands import Feedback, Reroute, UIEvent
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
        self, principal: Principal, conversation_id: UUID | None, command: Feedback
    ) -> Turn:
        """Record feedback on a completed turn of this tenant's conversation."""
        conversation, turn = await self._completed(principal, conversation_id, command.turn_id)
        if command.kind == "edit" and command.edited_text is None:
            raise InvalidFrame("feedback of kind edit needs edited_text")
        if command.kind != "edit" and command.edited_text is not None:
            raise InvalidFrame("edited_text goes only with feedback of kind edit")
        payload = FeedbackGiven(
            turn_id=turn.turn_id, kind=command.kind, edited_text=command.edited_text
        )
        # Feedback continues the turn's trace: what it teaches is followed from the turn.
        with observe.tracer.start_as_current_span(
            "ws.feedback",
            context=observe.context_of(turn.trace),
            attributes={"macaron.turn_id": str(turn.turn_id), "macaron.feedback": command.kind},
        ):
            await self._store.append(conversation, [payload], correlation_id=turn.turn_id)
        return turn

    async def reroute(
        self,
        principal: Principal,
        conversation_id: UUID | None,
        command: Reroute,
        active: frozenset[str],
    ) -> TurnRequest:
        """Record that ``command.specialist`` should have answered a completed turn, and the
        turn that answers its words again with that specialist."""
        conversation, turn = await self._completed(principal, conversation_id, command.turn_id)
        if command.specialist not in active:
            raise UnknownSpecialist(
                f"no active specialist {command.specialist!r}: choose one of {sorted(active)}"
            )
        if command.specialist == turn.specialist:
            raise InvalidFrame(f"turn {turn.turn_id} was answered by {turn.specialist} already")
        if turn.input_kind != "text":
            raise InvalidFrame("only a typed message can be rerouted")
        payload = RoutingCorrected(turn_id=turn.turn_id, specialist=command.specialist)
        with observe.tracer.start_as_current_span(
            "ws.reroute",
            context=observe.context_of(turn.trace),
            attributes={
                "macaron.turn_id": str(turn.turn_id),
                "macaron.specialist": command.specialist,
            },
        ):
            await self._store.append(conversation, [payload], correlation_id=turn.turn_id)
        return regeneration(turn, conversation_id, command.specialist)

    async def ui_event_turn(
        self, principal: Principal, conversation_id: UUID | None, command: UIEvent
    ) -> TurnRequest:
        """The harness input a GenUI interaction becomes: a turn of kind ``ui_event``."""
        _, turn = await self._completed(principal, conversation_id, command.turn_id)
        tree = turn.genui.tree if turn.genui is not None and turn.genui.valid else None
        if tree is None or command.component_id not in interactive_ids(tree):
            raise InvalidFrame(
                f"turn {command.turn_id} rendered no component {command.component_id!r}"
            )
        event: dict[str, JsonValue] = {
            "turn_id": str(command.turn_id),
            "component_id": command.component_id,
            "action": command.action,
            "value": command.value,
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
