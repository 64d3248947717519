"""The chat service: one user turn from receipt to durable completion, for every front end
(the WebSocket protocol and the OpenAI-compatible API).

A facade over the parts in ``server/turns/``: the release tracker, the conversation store, the
turn pipeline with its agent loop, the rate limit and feedback. Front ends, the promotion
listener and the composition root use only this.
"""

from __future__ import annotations

import asyncio
from uuid import UUID

from core.auth import Principal
from core.conversation import Conversation, Turn
from core.engine import Engine
from core.events import RequestedDecoding, utc_now
from core.harness.artifact import HarnessVersion
from core.log import EventLog
from core.release import Release, ServedRelease
from core.routing import RouterInvalid, RouterModel
from server.turns.agent import AgentLoop
from server.turns.commands import Feedback, Reroute, UIEvent
from server.turns.conversations import ConversationStore
from server.turns.feedback import TurnFeedback
from server.turns.items import Sink
from server.turns.pipeline import TurnPipeline
from server.turns.rate import MEMORY, TurnRateLimiter
from server.turns.request import ChatLimits, Router, TurnOutcome, TurnRequest, client_constraint
from server.turns.tracker import ReleaseTracker


class ChatService:
    def __init__(
        self,
        log: EventLog,
        engine: Engine,
        router: Router,
        served: ServedRelease,
        *,
        limits: ChatLimits | None = None,
        rate_storage: str = MEMORY,
    ) -> None:
        self.log = log
        self.engine = engine
        self.router = router
        self.limits = limits or ChatLimits()  # replaceable at run time: the parts read it per turn
        self.store = ConversationStore(log, utc_now, lambda: self.limits.max_cached_conversations)
        self._tracker = ReleaseTracker(engine, served.release, served.harness)
        self._rate = TurnRateLimiter(lambda: self.limits.turns_per_minute, rate_storage)
        agent = AgentLoop(engine, self.store, lambda: self.limits, utc_now)
        self._pipeline = TurnPipeline(self.store, self._tracker, router, agent)
        self._feedback = TurnFeedback(self.store)

    @property
    def release(self) -> Release:
        """The release new turns are answered with."""
        return self._tracker.release

    @property
    def harness(self) -> HarnessVersion:
        """The harness new turns are answered with (the one ``release`` names)."""
        return self._tracker.harness

    @property
    def specialists(self) -> list[str]:
        """The specialists a turn may go to now: the router's enabled ones, in its order."""
        active = self.router.active
        return [name for name in self.router.specialists if name in active]

    @property
    def serving_since(self) -> float:
        """The wall-clock moment ``release`` began to be served."""
        return self._tracker.serving_since

    def serve(self, served: ServedRelease, router: RouterModel | None = None) -> None:
        """Answer new turns with the release, the harness it names and, when it names another
        router version, its classifier ``router``, in one step. A turn keeps the release and
        harness it began with to its end; an adapter the new release does not serve is unloaded
        once no turn in flight uses it."""
        release = served.release
        if router is not None and router.version != release.router_version:
            raise RouterInvalid(
                f"release {release.release_id} names {release.router_version}, not {router.version}"
            )
        if router is not None:
            self.router.serve_model(router)
        self._tracker.serve(release, served.harness)

    async def conversation(self, principal: Principal, conversation_id: UUID) -> Conversation:
        """A conversation of this tenant (from memory, or rebuilt from the log)."""
        return await self.store.get(principal, conversation_id)

    async def run_turn(
        self, principal: Principal, request: TurnRequest, sink: Sink, cancel: asyncio.Event
    ) -> TurnOutcome:
        """Answer one turn, streaming its items to ``sink``; returns once the turn is durable."""
        await asyncio.to_thread(self._rate.check, principal.key_id)
        return await self._pipeline.run(principal, request, sink, cancel)

    async def check_output(self, asked: RequestedDecoding | None) -> None:
        """Refuse, before anything is recorded, a client's schema the engine cannot enforce
        (``GrammarUnbounded``, ``GrammarInvalid``): the engine checks and compiles it. Plain JSON
        (``json_object``) always can be."""
        constraint = None if asked is None else client_constraint(asked)
        if constraint is not None and constraint.kind == "json_schema":
            await asyncio.to_thread(self.engine.prepare, constraint)

    async def feedback(
        self, principal: Principal, conversation_id: UUID | None, command: Feedback
    ) -> Turn:
        """Record feedback on a completed turn of this tenant's conversation (a ``regenerate``
        asks for a turn: refused first, recording nothing, when the key is out of turns)."""
        if command.kind == "regenerate":
            await asyncio.to_thread(self._rate.room, principal.key_id)
        return await self._feedback.feedback(principal, conversation_id, command)

    async def reroute(
        self, principal: Principal, conversation_id: UUID | None, command: Reroute
    ) -> TurnRequest:
        """Record a routing correction on a completed turn; the turn that answers it again
        (refused first, recording nothing, when the key is out of turns)."""
        await asyncio.to_thread(self._rate.room, principal.key_id)
        return await self._feedback.reroute(principal, conversation_id, command, self.router.active)

    async def ui_event_turn(
        self, principal: Principal, conversation_id: UUID | None, command: UIEvent
    ) -> TurnRequest:
        """The harness input a GenUI interaction becomes: a turn of kind ``ui_event``."""
        return await self._feedback.ui_event_turn(principal, conversation_id, command)
