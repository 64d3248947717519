"""What a turn is asked and what it answers, whichever front end it came from, and what the
turn service needs of its router."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

from core.engine import OutputConstraint
from core.events import ChatMessage, FrontEnd, HarnessActionExecuted, RequestedDecoding
from core.harness.genui import GenUIResult, text_fallback
from core.routing import RouterDecision, RouterModel
from server.turns.items import GenUITree, TextDelta


class Router(Protocol):
    """What the chat service needs of a router (``server.router.RouterService`` in serving)."""

    @property
    def version(self) -> str: ...

    @property
    def specialists(self) -> tuple[str, ...]: ...

    @property
    def active(self) -> frozenset[str]:
        """The specialists it may choose (a turn may be rerouted to one of these)."""
        ...

    def route(
        self,
        text: str,
        hint: str | None = None,
        within: Collection[str] | None = None,
        tool_callers: Collection[str] = (),
        previous: str | None = None,
    ) -> RouterDecision:
        """The specialist for one turn, among ``within`` when given, preferring
        ``tool_callers`` (a request with client tools) or, for a short follow-up, ``previous``
        (the conversation's previous turn's) unless another is clearly meant."""
        ...

    def serve_model(self, model: RouterModel) -> None:
        """Route with the classifier of another router version (a promotion's)."""
        ...


@dataclass(frozen=True)
class ChatLimits:
    turns_per_minute: int = 30
    max_new_tokens: int = 256
    """A cap: each specialist's harness says how long its answers may be, up to this."""
    max_cached_conversations: int = 10_000


@dataclass(frozen=True)
class TurnRequest:
    """One turn to answer, whichever front end it came from."""

    client_msg_id: str
    content: str
    conversation_id: UUID | None = None
    specialist_hint: str | None = None
    input_kind: str = "text"
    history: tuple[ChatMessage, ...] = ()
    """Earlier messages for a new conversation (the OpenAI API brings them)."""
    regenerates: UUID | None = None
    """The turn this one answers again (a ``regenerate``)."""
    decoding: RequestedDecoding | None = None
    """What the client asked of the decoding (the OpenAI API's parameters)."""
    front_end: FrontEnd = "chat"
    client_tools: bool = False
    """The client offered tools an answer may call: the router prefers a specialist that calls
    tools."""


@dataclass
class TurnOutcome:
    turn_id: UUID
    conversation_id: UUID
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    genui: GenUIResult | None = None
    actions: list[HarnessActionExecuted] = field(default_factory=list)

    def genui_item(self, genui: GenUIResult) -> GenUITree | TextDelta:
        """How a GenUI answer is shown: the tree when it is valid, else its text fallback."""
        if genui.valid and genui.tree is not None:
            return GenUITree(turn_id=self.turn_id, tree=genui.tree)
        return TextDelta(turn_id=self.turn_id, delta=text_fallback(self.text, genui))


def client_constraint(asked: RequestedDecoding) -> OutputConstraint | None:
    """The output format the client asked for, enforced while decoding (``None``: none)."""
    if asked.output is None:
        return None
    return OutputConstraint(kind=asked.output, json_schema=asked.json_schema, or_text=asked.or_text)
