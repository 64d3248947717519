"""A conversation as its tenant may read it back (the admin API's transcript)."""

from __future__ import annotations

from uuid import UUID

from pydantic import BaseModel, JsonValue

from core.conversation import Conversation


class Transcript(BaseModel):
    """A conversation as its tenant may read it back."""

    conversation_id: UUID
    release_id: str | None
    turns: list[dict[str, JsonValue]]


def transcript(conversation: Conversation) -> Transcript:
    return Transcript(
        conversation_id=conversation.conversation_id,
        release_id=conversation.release_id,
        turns=[
            {
                "turn_id": str(t.turn_id),
                "client_msg_id": t.client_msg_id,
                "content": t.content,
                "input_kind": t.input_kind,
                "specialist": t.specialist,
                "adapter_version": t.adapter_version,
                "answer": t.answer,
                "completed": t.completed is not None,
                "feedback": [f.kind for f in t.feedback],
            }
            for t in conversation.turns.values()
        ],
    )
