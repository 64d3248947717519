"""The conversation aggregate: everything the server knows about one conversation, rebuilt by
applying its events in order (the log's key for a conversation is its id).

State changes only in ``apply``, dispatched by event type, so a conversation rebuilt from the
log on another server (after a reconnect or a crash) is the one that served the turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

from pydantic import JsonValue

from core.events import (
    ChatMessage,
    ConversationStarted,
    EventPayload,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    RequestedDecoding,
    RouterDecided,
    TurnCompleted,
    TurnReceived,
)
from core.log import RecordedEvent
from core.merge_patch import apply_merge_patch


def empty_tool_state() -> dict[str, JsonValue]:
    return {"notes": {}, "todos": {}, "next_todo": 1}


@dataclass
class Turn:
    turn_id: UUID
    client_msg_id: str
    content: str
    input_kind: str
    specialist: str | None = None
    adapter_version: str | None = None
    actions: list[HarnessActionExecuted] = field(default_factory=list)
    action_times: list[datetime] = field(default_factory=list)
    """When each action ran: the clock a replay must see."""
    genui: GenUIRendered | None = None
    response: ModelResponded | None = None
    completed: TurnCompleted | None = None
    feedback: list[FeedbackGiven] = field(default_factory=list)
    trace: dict[str, str] = field(default_factory=dict)
    """The trace context its receipt was written in: feedback on the turn continues it."""
    decoding: RequestedDecoding | None = None
    """What the client asked of its decoding: answering it again asks the same."""

    @property
    def answer(self) -> str | None:
        """The text the user saw last for this turn: an edit replaces the model's answer."""
        edits = [f.edited_text for f in self.feedback if f.kind == "edit" and f.edited_text]
        if edits:
            return edits[-1]
        return None if self.response is None else self.response.text


@dataclass
class Conversation:
    conversation_id: UUID
    tenant_id: str
    release_id: str | None = None
    version: int = 0
    """Sequence of the last applied event: the next append must land at ``version + 1``."""
    seed_history: list[ChatMessage] = field(default_factory=list)
    turns: dict[UUID, Turn] = field(default_factory=dict)
    by_client_msg: dict[str, UUID] = field(default_factory=dict)
    tool_state: dict[str, JsonValue] = field(default_factory=empty_tool_state)

    @property
    def key(self) -> str:
        return str(self.conversation_id)

    @classmethod
    def replay(cls, events: list[RecordedEvent]) -> Conversation | None:
        """Rebuild from a conversation's events (``None`` when there are none)."""
        if not events:
            return None
        first = events[0]
        payload = first.payload
        if not isinstance(payload, ConversationStarted):
            raise ValueError(f"conversation {first.envelope.key} does not begin with its start")
        conversation = cls(payload.conversation_id, first.envelope.tenant_id)
        for event in events:
            conversation.apply(event)
        return conversation

    def apply(self, event: RecordedEvent) -> None:
        self.apply_payload(event.envelope.sequence, event.payload, event.envelope.occurred_at)
        if isinstance(event.payload, TurnReceived):
            self.turns[event.payload.turn_id].trace = dict(event.envelope.trace)

    def apply_payload(self, sequence: int, payload: EventPayload, occurred_at: datetime) -> None:
        if sequence != self.version + 1:
            raise ValueError(
                f"conversation {self.conversation_id}: event {sequence} applied at {self.version}"
            )
        self.version = sequence
        match payload:
            case ConversationStarted():
                self.release_id = payload.release_id
                self.seed_history = list(payload.history)
            case TurnReceived():
                self.turns[payload.turn_id] = Turn(
                    payload.turn_id,
                    payload.client_msg_id,
                    payload.content,
                    payload.input_kind,
                    decoding=payload.decoding,
                )
                self.by_client_msg[payload.client_msg_id] = payload.turn_id
            case RouterDecided():
                turn = self.turns[payload.turn_id]
                turn.specialist, turn.adapter_version = payload.specialist, payload.adapter_version
            case HarnessActionExecuted():
                self.turns[payload.turn_id].actions.append(payload)
                self.turns[payload.turn_id].action_times.append(occurred_at)
                patched = apply_merge_patch(self.tool_state, payload.state_delta)
                if not isinstance(patched, dict):
                    raise ValueError("a state delta turned the tool state into a non-object")
                self.tool_state = patched
            case GenUIRendered():
                self.turns[payload.turn_id].genui = payload
            case ModelResponded():
                self.turns[payload.turn_id].response = payload
            case TurnCompleted():
                self.turns[payload.turn_id].completed = payload
            case FeedbackGiven():
                self.turns[payload.turn_id].feedback.append(payload)
            case _:
                pass  # events of other aggregates never share a conversation's key

    def history(self, max_turns: int) -> list[ChatMessage]:
        """The messages of the last ``max_turns`` completed turns, oldest first, after any
        history the conversation was started with."""
        done = [t for t in self.turns.values() if t.completed is not None]
        messages = list(self.seed_history)
        for turn in done[-max_turns:]:
            messages.append(ChatMessage(role="user", content=turn.content))
            messages.append(ChatMessage(role="assistant", content=turn.answer or ""))
        return messages
