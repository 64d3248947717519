"""A repeated ``client_msg_id`` (a client retrying after a lost connection): the recorded answer
again, never a second turn."""

from __future__ import annotations

from core.conversation import Conversation, Turn
from core.errors import TurnNotFound
from core.harness.genui import GenUIResult
from server.turns.items import Sink, TextDelta, TurnEnded, TurnStarted
from server.turns.request import TurnOutcome


async def resend(conversation: Conversation, turn: Turn, sink: Sink) -> TurnOutcome:
    """Send the completed ``turn``'s items again, marked ``resent``; appends nothing."""
    response, completed = turn.response, turn.completed
    if response is None or completed is None:
        raise TurnNotFound(f"turn {turn.turn_id} has no recorded answer")
    await sink(
        TurnStarted(
            turn_id=turn.turn_id,
            conversation_id=conversation.conversation_id,
            client_msg_id=turn.client_msg_id,
            specialist=response.specialist,
            adapter_version=response.adapter_version,
            release_id=response.release_id,
        )
    )
    outcome = TurnOutcome(
        turn.turn_id,
        conversation.conversation_id,
        response.text,
        response.finish_reason,
        response.prompt_tokens,
        response.completion_tokens,
        actions=list(turn.actions),
    )
    if turn.genui is not None:
        outcome.genui = GenUIResult(turn.genui.valid, turn.genui.tree or None, turn.genui.errors)
        await sink(outcome.genui_item(outcome.genui))
    else:
        await sink(TextDelta(turn_id=turn.turn_id, delta=response.text))
    await sink(
        TurnEnded(
            turn_id=turn.turn_id,
            latency_ms=completed.latency_ms,
            finish_reason=response.finish_reason,
            prompt_tokens=response.prompt_tokens,
            completion_tokens=response.completion_tokens,
            resent=True,
        )
    )
    return outcome
