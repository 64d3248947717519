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
from uuid import UUID

from opentelemetry import trace

from core.auth import Principal
from core.conversation import Conversation
from core.errors import AdapterNotFound, MacaronError
from core.events import (
    ConversationStarted,
    EventPayload,
    GenUIRendered,
    TurnCompleted,
    TurnReceived,
)
from core.harness.artifact import HarnessVersion
from core.harness.hcp import HISTORY_TURNS, HarnessContext, build_context
from core.ids import uuid7
from core.release import Release
from infra import observe
from server.turns.active import ActiveTurn, Route, TurnCall
from server.turns.agent import AgentLoop
from server.turns.conversations import ConversationStore
from server.turns.items import Sink, TurnEnded, TurnStarted
from server.turns.request import Router, TurnOutcome, TurnRequest
from server.turns.resend import resend
from server.turns.tracker import ReleaseTracker

_log = logging.getLogger(__name__)


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
        """Answer one turn, streaming its items to ``sink``; returns once the turn is durable."""
        call = TurnCall(request, sink, cancel, time.monotonic())
        if request.conversation_id is None:
            conversation = Conversation(uuid7(), principal.tenant_id)
        else:
            conversation = await self._store.get(principal, request.conversation_id)
        key, tenant = conversation.conversation_id, principal.tenant_id
        with self._store.answering(key), self._tracker.turn() as (release, harness):
            trace.get_current_span().set_attribute("macaron.conversation_id", str(key))
            if request.conversation_id is None:
                self._store.remember(conversation)
            try:
                outcome = await self._run(conversation, call, release, harness)
            except MacaronError as exc:
                observe.turns.add(1, {"outcome": exc.code})
                _log.warning(
                    "turn of conversation %s failed: %s (tenant %s)", key, exc.code, tenant
                )
                raise
        seconds = time.monotonic() - call.arrived
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
        self, conversation: Conversation, call: TurnCall, release: Release, harness: HarnessVersion
    ) -> TurnOutcome:
        """Resend a completed turn, or route, record the receipt, answer and complete it."""
        request = call.request
        earlier = conversation.by_client_msg.get(request.client_msg_id)
        if earlier is not None and conversation.turns[earlier].completed is not None:
            return await resend(conversation, conversation.turns[earlier], call.sink)
        route = await self._route(request, release, harness, previous_specialist(conversation))
        turn_id = earlier if earlier is not None else uuid7()
        trace.get_current_span().set_attributes(
            {
                "macaron.turn_id": str(turn_id),
                "macaron.specialist": route.specialist,
                "macaron.adapter": route.adapter.name,
                "macaron.release_id": release.release_id,
            }
        )
        events = _opening(conversation, request, release)
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
        outcome = TurnOutcome(turn_id, conversation.conversation_id, "", "stop")
        turn = ActiveTurn(conversation, call, route, outcome, receipt)
        await turn.emit(
            TurnStarted(
                turn_id=turn_id,
                conversation_id=conversation.conversation_id,
                client_msg_id=request.client_msg_id,
                specialist=route.specialist,
                adapter_version=route.adapter.name,
                release_id=release.release_id,
            )
        )
        await self._answer(turn, context)
        await self._complete(turn)
        return outcome

    async def _route(
        self,
        request: TurnRequest,
        release: Release,
        harness: HarnessVersion,
        previous: str | None,
    ) -> Route:
        """The specialist for this turn, and its adapter in the turn's release; ``previous``
        answered the conversation's last completed turn."""
        with observe.tracer.start_as_current_span("router.decide") as span:
            decision = await asyncio.to_thread(
                self._router.route,
                request.content,
                request.specialist_hint,
                release.adapters,
                tool_callers(harness) if request.client_tools else (),
                previous,
            )
            span.set_attribute("macaron.specialist", decision.specialist)
        observe.router_decisions.add(1, {"specialist": decision.specialist})
        adapter = release.adapter_for(decision.specialist)
        if adapter is None:
            raise AdapterNotFound(
                f"release {release.release_id} has no adapter for {decision.specialist}"
            )
        return Route(release, harness, decision, adapter)

    async def _answer(self, turn: ActiveTurn, context: HarnessContext) -> None:
        """Run the agent loop; if it fails, record a response of finish ``error`` and re-raise.
        Either way the receipt is stored (or has failed) before this returns."""
        receipt = turn.receipt
        try:
            await self._agent.answer(turn, context)
        except MacaronError:
            await receipt
            await self._store.append(
                turn.conversation,
                [turn.route.responded(turn.outcome, "error")],
                correlation_id=turn.turn_id,
            )
            raise
        finally:
            if not receipt.done():
                await asyncio.wait([receipt])
        await receipt

    async def _complete(self, turn: ActiveTurn) -> None:
        """Record the answer (GenUI tree, response, completion), then tell the client."""
        outcome, harness = turn.outcome, turn.route.harness
        final: list[EventPayload] = []
        if outcome.genui is not None:
            final.append(
                GenUIRendered(
                    turn_id=outcome.turn_id,
                    tree=outcome.genui.tree or {},
                    valid=outcome.genui.valid,
                    errors=outcome.genui.errors,
                    catalogue_version=harness.spec.catalogue_version,
                    harness=harness.stamp,
                )
            )
            await turn.emit(outcome.genui_item(outcome.genui))
        latency_ms = (time.monotonic() - turn.call.arrived) * 1000
        final.append(turn.route.responded(outcome, outcome.finish_reason))
        final.append(
            TurnCompleted(turn_id=outcome.turn_id, latency_ms=latency_ms, harness=harness.stamp)
        )
        await self._store.append(turn.conversation, final, correlation_id=outcome.turn_id)
        await turn.emit(
            TurnEnded(
                turn_id=outcome.turn_id,
                latency_ms=latency_ms,
                finish_reason=outcome.finish_reason,
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
            )
        )


def _opening(
    conversation: Conversation, request: TurnRequest, release: Release
) -> list[EventPayload]:
    """The events that start a new conversation (none for one that goes on)."""
    if request.conversation_id is not None:
        return []
    started = ConversationStarted(
        conversation_id=conversation.conversation_id,
        release_id=release.release_id,
        history=list(request.history),
    )
    return [started]


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
        front_end=request.front_end,
    )


def tool_callers(harness: HarnessVersion) -> tuple[str, ...]:
    """The specialists whose answers may be tool calls under ``harness``."""
    return tuple(
        name for name, spec in harness.spec.specialists.items() if "tool_call" in spec.output
    )


def previous_specialist(conversation: Conversation) -> str | None:
    """The specialist that answered the conversation's last completed turn (``None``: none)."""
    done = [t for t in conversation.turns.values() if t.completed is not None]
    return done[-1].specialist if done else None
