"""One user turn from receipt to durable completion.

A turn is: ``TurnReceived`` + ``RouterDecided`` appended; the harness builds the HCP context and
the agent loop generates with the chosen specialist's adapter (actions and GenUI included);
``ModelResponded`` + ``TurnCompleted`` are appended, and only then is the turn reported complete.
Every append names the sequence the conversation must be at, so two servers can never interleave
one conversation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from uuid import UUID

from opentelemetry import trace

from core.auth import Principal
from core.conversation import Conversation
from core.errors import AdapterNotFound, MacaronError
from core.events import (
    ConversationStarted,
    EventPayload,
    GenUIRendered,
    ModelResponded,
    RequestedDecoding,
    TurnCompleted,
    TurnReceived,
)
from core.harness.artifact import HarnessVersion
from core.harness.hcp import HISTORY_TURNS, HarnessContext, build_context
from core.ids import uuid7
from core.release import AdapterRef, Release
from core.routing import RouterDecision
from infra import observe
from server import protocol as wire
from server.turns.agent import AgentLoop
from server.turns.conversations import ConversationStore
from server.turns.request import Router, Sink, TurnOutcome, TurnRequest
from server.turns.resend import resend
from server.turns.tracker import ReleaseTracker

_log = logging.getLogger(__name__)


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


class TurnPipeline:
    def __init__(
        self,
        store: ConversationStore,
        tracker: ReleaseTracker,
        router: Router,
        agent: AgentLoop,
    ) -> None:
        self._router = router
        self._store = store
        self._tracker = tracker
        self._agent = agent

    async def run(
        self, principal: Principal, request: TurnRequest, sink: Sink, cancel: asyncio.Event
    ) -> TurnOutcome:
        """Answer one turn, streaming frames to ``sink``; returns once the turn is durable."""
        started = time.monotonic()
        if request.conversation_id is None:
            conversation = Conversation(uuid7(), principal.tenant_id)
        else:
            conversation = await self._store.get(principal, request.conversation_id)
        key, tenant = conversation.conversation_id, principal.tenant_id
        with self._store.answering(key), self._tracker.turn() as (release, harness):
            trace.get_current_span().set_attribute("macaron.conversation_id", str(key))
            opening: list[EventPayload] = []
            if request.conversation_id is None:
                opening.append(
                    ConversationStarted(
                        conversation_id=key,
                        release_id=release.release_id,
                        history=list(request.history),
                    )
                )
                self._store.remember(conversation)
            try:
                outcome = await self._run(
                    conversation, request, release, harness, opening, sink, cancel, started
                )
            except MacaronError as exc:
                observe.turns.add(1, {"outcome": exc.code})
                _log.warning(
                    "turn of conversation %s failed: %s (tenant %s)", key, exc.code, tenant
                )
                raise
        seconds = time.monotonic() - started
        observe.turns.add(1, {"outcome": outcome.finish_reason})
        observe.turn_latency.record(seconds)
        _log.info(
            "turn %s completed: %s in %.0f ms (tenant %s, conversation %s)",
            outcome.turn_id,
            outcome.finish_reason,
            seconds * 1000,
            tenant,
            key,
        )
        return outcome

    async def _run(
        self,
        conversation: Conversation,
        request: TurnRequest,
        release: Release,
        harness: HarnessVersion,
        opening: list[EventPayload],
        sink: Sink,
        cancel: asyncio.Event,
        started: float,
    ) -> TurnOutcome:
        """Resend a completed turn, or route, record the receipt, answer and complete it."""
        earlier = conversation.by_client_msg.get(request.client_msg_id)
        if earlier is not None and conversation.turns[earlier].completed is not None:
            return await resend(conversation, conversation.turns[earlier], sink)
        route = await self._route(request, release, harness)
        turn_id = earlier if earlier is not None else uuid7()
        trace.get_current_span().set_attributes(
            {
                "macaron.turn_id": str(turn_id),
                "macaron.specialist": route.specialist,
                "macaron.adapter": route.adapter.name,
                "macaron.release_id": release.release_id,
            }
        )
        events = list(opening)
        if earlier is None:  # a resent turn that never completed goes on under its first id
            events.append(_received(conversation, request, route, turn_id))
        events.append(route.decision.to_event(turn_id, route.adapter.name, harness.stamp))
        with observe.tracer.start_as_current_span("harness.context"):
            history = conversation.history(HISTORY_TURNS)
            context = build_context(harness, route.specialist, history, request.content)
        # The receipt is written while the answer is generated; everything after it (actions,
        # the response) waits for it, so the log's order is the turn's order.
        receipt = asyncio.create_task(
            self._store.append(conversation, events, correlation_id=turn_id)
        )
        await sink(
            wire.TurnStarted(
                turn_id=turn_id,
                conversation_id=conversation.conversation_id,
                client_msg_id=request.client_msg_id,
                specialist=route.specialist,
                adapter_version=route.adapter.name,
                release_id=release.release_id,
            )
        )
        outcome = TurnOutcome(turn_id, conversation.conversation_id, "", "stop")
        await self._answer(
            conversation, context, route, request.decoding, outcome, sink, cancel, receipt
        )
        await self._complete(conversation, route, outcome, sink, started)
        return outcome

    async def _route(
        self, request: TurnRequest, release: Release, harness: HarnessVersion
    ) -> Route:
        """The specialist for this turn, and its adapter in the turn's release."""
        with observe.tracer.start_as_current_span("router.decide") as span:
            decision = await asyncio.to_thread(
                self._router.route, request.content, request.specialist_hint, release.adapters
            )
            span.set_attribute("macaron.specialist", decision.specialist)
        observe.router_decisions.add(1, {"specialist": decision.specialist})
        adapter = release.adapter_for(decision.specialist)
        if adapter is None:
            raise AdapterNotFound(
                f"release {release.release_id} has no adapter for {decision.specialist}"
            )
        return Route(release, harness, decision, adapter)

    async def _answer(
        self,
        conversation: Conversation,
        context: HarnessContext,
        route: Route,
        requested: RequestedDecoding | None,
        outcome: TurnOutcome,
        sink: Sink,
        cancel: asyncio.Event,
        receipt: asyncio.Task[None],
    ) -> None:
        """Run the agent loop; if it fails, record a response of finish ``error`` and re-raise.
        Either way the receipt is stored (or has failed) before this returns."""
        try:
            await self._agent.answer(
                conversation,
                context,
                route.adapter,
                route.harness.spec,
                route.specialist,
                requested,
                outcome,
                sink,
                cancel,
                receipt,
            )
        except MacaronError:
            await receipt
            await self._store.append(
                conversation, [route.responded(outcome, "error")], correlation_id=outcome.turn_id
            )
            raise
        finally:
            if not receipt.done():
                await asyncio.wait([receipt])
        await receipt

    async def _complete(
        self,
        conversation: Conversation,
        route: Route,
        outcome: TurnOutcome,
        sink: Sink,
        started: float,
    ) -> None:
        """Record the answer (GenUI tree, response, completion), then tell the client."""
        final: list[EventPayload] = []
        if outcome.genui is not None:
            final.append(
                GenUIRendered(
                    turn_id=outcome.turn_id,
                    tree=outcome.genui.tree or {},
                    valid=outcome.genui.valid,
                    errors=outcome.genui.errors,
                    catalogue_version=route.harness.spec.catalogue_version,
                    harness=route.harness.stamp,
                )
            )
            await sink(outcome.genui_frame(outcome.genui))
        latency_ms = (time.monotonic() - started) * 1000
        final.append(route.responded(outcome, outcome.finish_reason))
        final.append(
            TurnCompleted(
                turn_id=outcome.turn_id, latency_ms=latency_ms, harness=route.harness.stamp
            )
        )
        await self._store.append(conversation, final, correlation_id=outcome.turn_id)
        usage = wire.Usage(
            prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens
        )
        await sink(
            wire.TurnCompleted(
                turn_id=outcome.turn_id,
                latency_ms=latency_ms,
                finish_reason=outcome.finish_reason,
                usage=usage,
            )
        )


def _received(
    conversation: Conversation, request: TurnRequest, route: Route, turn_id: UUID
) -> TurnReceived:
    return TurnReceived(
        conversation_id=conversation.conversation_id,
        turn_id=turn_id,
        client_msg_id=request.client_msg_id,
        content=request.content,
        specialist_hint=request.specialist_hint,
        input_kind="ui_event" if request.input_kind == "ui_event" else "text",
        release_id=route.release.release_id,
        harness=route.harness.stamp,
        regenerates=request.regenerates,
        decoding=request.decoding,
    )
