"""A turn while it is answered, as one object: what was asked and where its items go, where
the router sent it, what it has answered so far, and its receipt. (``core.conversation.Turn`` is
a turn as the log records it.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from uuid import UUID

from core.conversation import Conversation
from core.events import ModelResponded
from core.harness.artifact import HarnessVersion
from core.release import AdapterRef, Release
from core.routing import RouterDecision
from server.turns.items import Sink, TurnItem
from server.turns.request import TurnOutcome, TurnRequest


@dataclass(frozen=True)
class TurnCall:
    """A front end's call for a turn: the request, where its items go, the token that cancels
    it, and when it arrived (``time.monotonic``)."""

    request: TurnRequest
    sink: Sink
    cancel: asyncio.Event
    arrived: float


@dataclass(frozen=True)
class Route:
    """Where the router sent a turn: a specialist, and its adapter in the turn's release, and
    the release's harness."""

    release: Release
    harness: HarnessVersion
    decision: RouterDecision
    adapter: AdapterRef

    @property
    def specialist(self) -> str:
        return self.decision.specialist

    def responded(self, outcome: TurnOutcome, finish: str) -> ModelResponded:
        return ModelResponded(
            turn_id=outcome.turn_id,
            release_id=self.release.release_id,
            specialist=self.specialist,
            adapter_version=self.adapter.name,
            harness=self.harness.stamp,
            text=outcome.text,
            finish_reason=finish,  # type: ignore[arg-type]  # one of FinishReason or "error"
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        )


@dataclass(frozen=True)
class ActiveTurn:
    """One routed turn from its receipt to its completion. ``outcome`` fills as it is answered;
    ``receipt`` is the append of its first events, which everything recorded after waits for."""

    conversation: Conversation
    call: TurnCall
    route: Route
    outcome: TurnOutcome
    receipt: asyncio.Task[None]

    @property
    def turn_id(self) -> UUID:
        return self.outcome.turn_id

    @property
    def cancelled(self) -> bool:
        return self.call.cancel.is_set()

    async def emit(self, item: TurnItem) -> None:
        await self.call.sink(item)
