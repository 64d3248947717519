"""The chat service: one user turn from receipt to durable completion, for every front end
(the WebSocket protocol and the OpenAI-compatible API).

A turn is: ``TurnReceived`` + ``RouterDecided`` appended; the harness builds the HCP context and
the engine streams the answer with the chosen specialist's adapter; agent tool calls run in the
action substrate (``HarnessActionExecuted`` each); GenUI trees are validated (``GenUIRendered``);
``ModelResponded`` + ``TurnCompleted`` are appended, and only then is the turn reported complete.
Every append names the sequence the conversation must be at, so two servers can never interleave
one conversation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol
from uuid import UUID

from opentelemetry import trace
from pydantic import BaseModel, JsonValue

from core.auth import Principal
from core.conversation import Conversation, Turn
from core.engine import Engine, GenerationRequest, SamplingParams
from core.errors import (
    AdapterNotFound,
    ConversationNotFound,
    InvalidFrame,
    MacaronError,
    RateLimited,
    TurnInFlight,
    TurnNotFound,
)
from core.events import (
    ChatMessage,
    ConversationStarted,
    EventPayload,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    NewEvent,
    TurnCompleted,
    TurnReceived,
    utc_now,
)
from core.harness.actions import MAX_ACTIONS_PER_TURN, execute
from core.harness.genui import (
    CATALOGUE_VERSION,
    GenUIResult,
    interactive_ids,
    parse_genui_output,
    text_fallback,
)
from core.harness.hcp import (
    HISTORY_TURNS,
    STAMP,
    HarnessContext,
    build_context,
    looks_structured,
    tool_call_of,
)
from core.ids import uuid7
from core.log import EventLog
from core.release import AdapterRef, Release
from core.routing import RouterDecision
from infra import observe
from server import protocol as wire
from server.committer import GroupCommitter

Sink = Callable[[wire.Frame], Awaitable[None]]
_log = logging.getLogger(__name__)


class Router(Protocol):
    """What the chat service needs of a router (``server.router.RouterService`` in serving)."""

    @property
    def version(self) -> str: ...

    @property
    def specialists(self) -> tuple[str, ...]: ...

    def route(self, text: str, hint: str | None = None) -> RouterDecision: ...


@dataclass(frozen=True)
class ChatLimits:
    turns_per_minute: int = 30
    max_new_tokens: int = 256
    temperature: float = 0.7
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


class ChatService:
    def __init__(
        self,
        log: EventLog,
        engine: Engine,
        router: Router,
        release: Release,
        *,
        limits: ChatLimits | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.log = log
        self.engine = engine
        self.router = router
        self.release = release
        self.serving_since = time.time()  # wall-clock moment ``release`` began to be served
        self.limits = limits or ChatLimits()
        self._clock = clock
        self._committer = GroupCommitter(log)
        self._conversations: OrderedDict[UUID, Conversation] = OrderedDict()
        self._in_flight: set[UUID] = set()
        self._recent_turns: dict[UUID, deque[float]] = {}
        self._turns_on: Counter[str] = Counter()  # turns in flight, by the release they began on
        self._busy: dict[str, Release] = {}  # those releases
        self._unused: set[str] = set()  # adapters a past release served: unload once unused

    def serve(self, release: Release) -> None:
        """Answer new turns with ``release``. A turn keeps the release it began with to its end;
        an adapter the new release does not serve is unloaded once no turn in flight uses it."""
        old, self.release = self.release, release
        self.serving_since = time.time()
        self._unused |= {ref.name for ref in old.adapters.values()}
        self._unload_unused()
        _log.info("serving release %s", release.release_id)

    def _turn_began(self, release: Release) -> None:
        self._turns_on[release.release_id] += 1
        self._busy[release.release_id] = release

    def _turn_ended(self, release: Release) -> None:
        self._turns_on[release.release_id] -= 1
        if not self._turns_on[release.release_id]:
            del self._turns_on[release.release_id], self._busy[release.release_id]
            self._unload_unused()

    def _unload_unused(self) -> None:
        serving = [self.release, *self._busy.values()]
        used = {ref.name for r in serving for ref in r.adapters.values()}
        loaded = set(self.engine.loaded_adapters())
        for name in self._unused - used:
            if name in loaded:
                try:
                    self.engine.unload_adapter(name)
                except MacaronError as exc:  # the turn that ended must not fail for this
                    _log.warning("could not unload adapter %s: %s", name, exc.message)
        self._unused &= used
        observe.adapters_loaded.set(len(self.engine.loaded_adapters()))

    # --- conversations ----------------------------------------------------------------------

    async def conversation(self, principal: Principal, conversation_id: UUID) -> Conversation:
        """A conversation of this tenant (from memory, or rebuilt from the log)."""
        found = self._conversations.get(conversation_id)
        if found is None:
            events = await asyncio.to_thread(lambda: list(self.log.read(key=str(conversation_id))))
            found = Conversation.replay(events)
            if found is not None:
                self._remember(found)
        if found is None or found.tenant_id != principal.tenant_id:
            raise ConversationNotFound(f"no conversation {conversation_id}")
        self._conversations.move_to_end(conversation_id)
        return found

    def _remember(self, conversation: Conversation) -> None:
        self._conversations[conversation.conversation_id] = conversation
        while len(self._conversations) > self.limits.max_cached_conversations:
            oldest = next(iter(self._conversations))
            if oldest in self._in_flight:
                break
            del self._conversations[oldest]

    async def _append(
        self,
        conversation: Conversation,
        payloads: Sequence[EventPayload],
        *,
        correlation_id: UUID | None,
        at: datetime | None = None,
    ) -> None:
        """Append at the conversation's next sequences and apply what was stored. Any failure
        forgets the cached conversation, so the next use rebuilds it from the log."""
        base, when, headers = conversation.version, at or self._clock(), observe.carrier()
        events = [
            NewEvent(
                payload=payload,
                tenant_id=conversation.tenant_id,
                key=conversation.key,
                sequence=base + i + 1,
                correlation_id=correlation_id,
                occurred_at=when,
                trace=headers,
            )
            for i, payload in enumerate(payloads)
        ]
        try:
            with observe.tracer.start_as_current_span(
                "log.append", attributes={"macaron.events": [e.payload.event_type for e in events]}
            ):
                recorded = await self._committer.append(events)
        except BaseException:
            self._conversations.pop(conversation.conversation_id, None)
            raise
        for event in recorded:
            conversation.apply(event)

    # --- turns ------------------------------------------------------------------------------

    async def run_turn(
        self, principal: Principal, request: TurnRequest, sink: Sink, cancel: asyncio.Event
    ) -> TurnOutcome:
        """Answer one turn, streaming frames to ``sink``; returns once the turn is durable."""
        self._check_rate(principal)
        started = time.monotonic()
        if request.conversation_id is None:
            conversation = Conversation(uuid7(), principal.tenant_id)
        else:
            conversation = await self.conversation(principal, request.conversation_id)
        key = conversation.conversation_id
        if key in self._in_flight:
            raise TurnInFlight(f"conversation {key} is answering another turn")
        # The turn's release, held until the turn ends: no await between reading it and
        # counting the turn in, so a promotion cannot unload its adapters in between.
        release = self.release
        opening: list[EventPayload] = (
            []
            if request.conversation_id is not None
            else [
                ConversationStarted(
                    conversation_id=key,
                    release_id=release.release_id,
                    history=list(request.history),
                )
            ]
        )
        self._in_flight.add(key)
        self._turn_began(release)
        trace.get_current_span().set_attribute("macaron.conversation_id", str(key))
        try:
            if opening:
                self._remember(conversation)
            outcome = await self._run(
                conversation, request, release, opening, sink, cancel, started
            )
        except MacaronError as exc:
            observe.turns.add(1, {"outcome": exc.code})
            _log.warning(
                "turn in conversation %s failed: %s (tenant %s)", key, exc.code, principal.tenant_id
            )
            raise
        finally:
            self._in_flight.discard(key)
            self._turn_ended(release)
        seconds = time.monotonic() - started
        observe.turns.add(1, {"outcome": outcome.finish_reason})
        observe.turn_latency.record(seconds)
        _log.info(
            "turn %s completed: %s in %.0f ms (tenant %s, conversation %s)",
            outcome.turn_id,
            outcome.finish_reason,
            seconds * 1000,
            principal.tenant_id,
            key,
        )
        return outcome

    async def _run(
        self,
        conversation: Conversation,
        request: TurnRequest,
        release: Release,
        opening: list[EventPayload],
        sink: Sink,
        cancel: asyncio.Event,
        started: float,
    ) -> TurnOutcome:
        earlier = conversation.by_client_msg.get(request.client_msg_id)
        if earlier is not None and conversation.turns[earlier].completed is not None:
            return await self._resend(conversation, conversation.turns[earlier], sink)
        with observe.tracer.start_as_current_span("router.decide") as span:
            decision = await asyncio.to_thread(
                self.router.route, request.content, request.specialist_hint
            )
            span.set_attribute("macaron.specialist", decision.specialist)
        observe.router_decisions.add(1, {"specialist": decision.specialist})
        adapter = release.adapter_for(decision.specialist)
        if adapter is None:
            raise AdapterNotFound(
                f"release {release.release_id} has no adapter for {decision.specialist}"
            )
        turn_id = earlier if earlier is not None else uuid7()
        trace.get_current_span().set_attributes(
            {
                "macaron.turn_id": str(turn_id),
                "macaron.specialist": decision.specialist,
                "macaron.adapter": adapter.name,
                "macaron.release_id": release.release_id,
            }
        )
        events = list(opening)
        if earlier is None:  # a resent turn that never completed goes on under its first id
            events.append(
                TurnReceived(
                    conversation_id=conversation.conversation_id,
                    turn_id=turn_id,
                    client_msg_id=request.client_msg_id,
                    content=request.content,
                    specialist_hint=request.specialist_hint,
                    input_kind="ui_event" if request.input_kind == "ui_event" else "text",
                    release_id=release.release_id,
                    harness=STAMP,
                )
            )
        events.append(decision.to_event(turn_id, adapter.name, STAMP))
        with observe.tracer.start_as_current_span("harness.context"):
            history = conversation.history(HISTORY_TURNS)
            context = build_context(decision.specialist, history, request.content)
        # The receipt is written while the answer is generated; everything after it (actions,
        # the response) waits for it, so the log's order is the turn's order.
        receipt = asyncio.create_task(self._append(conversation, events, correlation_id=turn_id))
        await sink(
            wire.TurnStarted(
                turn_id=turn_id,
                conversation_id=conversation.conversation_id,
                client_msg_id=request.client_msg_id,
                specialist=decision.specialist,
                adapter_version=adapter.name,
                release_id=release.release_id,
            )
        )
        outcome = TurnOutcome(turn_id, conversation.conversation_id, "", "stop")
        try:
            await self._answer(conversation, context, adapter, outcome, sink, cancel, receipt)
        except MacaronError:
            await receipt
            await self._append(
                conversation,
                [self._responded(release, decision.specialist, adapter, outcome, "error")],
                correlation_id=turn_id,
            )
            raise
        finally:
            if not receipt.done():
                await asyncio.wait([receipt])
        await receipt
        final: list[EventPayload] = []
        if outcome.genui is not None:
            final.append(
                GenUIRendered(
                    turn_id=turn_id,
                    tree=outcome.genui.tree or {},
                    valid=outcome.genui.valid,
                    errors=outcome.genui.errors,
                    catalogue_version=CATALOGUE_VERSION,
                    harness=STAMP,
                )
            )
            await sink(self._genui_frame(turn_id, outcome.text, outcome.genui))
        latency_ms = (time.monotonic() - started) * 1000
        final.append(
            self._responded(release, decision.specialist, adapter, outcome, outcome.finish_reason)
        )
        final.append(TurnCompleted(turn_id=turn_id, latency_ms=latency_ms, harness=STAMP))
        await self._append(conversation, final, correlation_id=turn_id)
        await sink(
            wire.TurnCompleted(
                turn_id=turn_id,
                latency_ms=latency_ms,
                finish_reason=outcome.finish_reason,
                usage=wire.Usage(
                    prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens
                ),
            )
        )
        return outcome

    @staticmethod
    def _responded(
        release: Release, specialist: str, adapter: AdapterRef, outcome: TurnOutcome, finish: str
    ) -> ModelResponded:
        return ModelResponded(
            turn_id=outcome.turn_id,
            release_id=release.release_id,
            specialist=specialist,
            adapter_version=adapter.name,
            harness=STAMP,
            text=outcome.text,
            finish_reason=finish,  # type: ignore[arg-type]  # one of FinishReason or "error"
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        )

    async def _answer(
        self,
        conversation: Conversation,
        context: HarnessContext,
        adapter: AdapterRef,
        outcome: TurnOutcome,
        sink: Sink,
        cancel: asyncio.Event,
        receipt: asyncio.Task[None],
    ) -> None:
        """Generate, running tool calls until the model answers in text (or the limit)."""
        scratch: list[ChatMessage] = []
        for step in range(MAX_ACTIONS_PER_TURN + 1):
            step_context = context.model_copy(update={"scratch": tuple(scratch)})
            text = await self._generate(step_context, adapter, outcome, step, sink, cancel)
            call = tool_call_of(text) if "tool_call" in context.grammars else None
            if call is None or outcome.finish_reason == "cancelled":
                break
            if step == MAX_ACTIONS_PER_TURN:
                outcome.text = f"I stopped after {MAX_ACTIONS_PER_TURN} actions in one turn."
                await sink(wire.Token(turn_id=outcome.turn_id, delta=outcome.text))
                return
            await receipt
            now = self._clock()
            with observe.tracer.start_as_current_span("harness.action") as span:
                done = execute(call, conversation.tool_state, now)
                span.set_attributes({"macaron.tool": done.name, "macaron.ok": done.ok})
            action = HarnessActionExecuted(
                turn_id=outcome.turn_id,
                action_id=uuid7(),
                name=done.name,
                args=done.args,
                result=done.result,
                ok=done.ok,
                state_delta=done.state_delta,
                harness=STAMP,
            )
            await self._append(conversation, [action], correlation_id=outcome.turn_id, at=now)
            outcome.actions.append(action)
            await sink(
                wire.Action(
                    turn_id=outcome.turn_id,
                    name=done.name,
                    args=done.args,
                    result=done.result,
                    ok=done.ok,
                )
            )
            scratch.append(ChatMessage(role="assistant", content=text.strip()))
            result = json.dumps({"tool": done.name, "ok": done.ok, "result": done.result})
            scratch.append(ChatMessage(role="user", content=f"Tool result: {result}"))
        outcome.text = text
        if "genui" in context.grammars and outcome.finish_reason != "cancelled":
            outcome.genui = parse_genui_output(text)

    async def _generate(
        self,
        context: HarnessContext,
        adapter: AdapterRef,
        outcome: TurnOutcome,
        step: int,
        sink: Sink,
        cancel: asyncio.Event,
    ) -> str:
        """One generation step. Text is streamed as it comes, unless the answer may be JSON
        (a tool call or a GenUI tree): that is held back until it can be judged whole."""
        prompt = self.engine.chat_prompt(context.messages())
        request = GenerationRequest(
            request_id=f"{outcome.turn_id}.{step}",
            prompt=prompt,
            adapter=adapter.name,
            params=SamplingParams(
                max_tokens=self.limits.max_new_tokens,
                temperature=self.limits.temperature,
                seed=(outcome.turn_id.int + step) % 2**63,
            ),
        )
        hold = "genui" in context.grammars
        undecided = "tool_call" in context.grammars
        text, sent, tokens, first = "", 0, 0, None
        submitted = time.monotonic()
        chunks = self.engine.generate(request)
        observe.engine_in_flight.add(1)
        with observe.tracer.start_as_current_span(
            "engine.generate",
            attributes={
                "macaron.adapter": adapter.name,
                "macaron.step": step,
            },
        ) as span:
            try:
                async for chunk in chunks:
                    if first is None and chunk.text:
                        first = time.monotonic() - submitted
                    text += chunk.text
                    outcome.prompt_tokens = max(outcome.prompt_tokens, chunk.prompt_tokens)
                    if chunk.finish_reason is not None:
                        tokens = chunk.completion_tokens
                        outcome.completion_tokens += chunk.completion_tokens
                        outcome.finish_reason = chunk.finish_reason
                    if cancel.is_set():
                        outcome.finish_reason = "cancelled"
                        break
                    if undecided and text.strip():
                        hold, undecided = looks_structured(text), False
                    if not hold and not undecided and len(text) > sent:
                        await sink(wire.Token(turn_id=outcome.turn_id, delta=text[sent:]))
                        sent = len(text)
            finally:
                await chunks.aclose()
                observe.engine_in_flight.add(-1)
                observe.tokens.add(tokens, {"adapter": adapter.name})
                if first is not None:
                    span.set_attribute("macaron.time_to_first_token_ms", first * 1000)
                    if step == 0:
                        observe.time_to_first_token.record(first)
                span.set_attributes(
                    {"macaron.tokens": tokens, "macaron.finish_reason": outcome.finish_reason}
                )
        if hold and "genui" not in context.grammars and tool_call_of(text) is None:
            await sink(wire.Token(turn_id=outcome.turn_id, delta=text))  # JSON, not a call
        return text

    @staticmethod
    def _genui_frame(turn_id: UUID, text: str, result: GenUIResult) -> wire.Frame:
        if result.valid and result.tree is not None:
            return wire.GenUI(turn_id=turn_id, tree=result.tree)
        return wire.Token(turn_id=turn_id, delta=text_fallback(text, result))

    async def _resend(self, conversation: Conversation, turn: Turn, sink: Sink) -> TurnOutcome:
        """A repeated ``client_msg_id``: the recorded answer again, never a second turn."""
        response, completed = turn.response, turn.completed
        if response is None or completed is None:
            raise TurnNotFound(f"turn {turn.turn_id} has no recorded answer")
        await sink(
            wire.TurnStarted(
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
            result = GenUIResult(turn.genui.valid, turn.genui.tree or None, turn.genui.errors)
            outcome.genui = result
            await sink(self._genui_frame(turn.turn_id, response.text, result))
        else:
            await sink(wire.Token(turn_id=turn.turn_id, delta=response.text))
        await sink(
            wire.TurnCompleted(
                turn_id=turn.turn_id,
                latency_ms=completed.latency_ms,
                finish_reason=response.finish_reason,
                resent=True,
                usage=wire.Usage(
                    prompt_tokens=response.prompt_tokens,
                    completion_tokens=response.completion_tokens,
                ),
            )
        )
        return outcome

    def _check_rate(self, principal: Principal) -> None:
        """At most ``turns_per_minute`` turns per key in any sliding minute."""
        now = time.monotonic()
        window = self._recent_turns.setdefault(principal.key_id, deque())
        while window and now - window[0] > 60:
            window.popleft()
        if len(window) >= self.limits.turns_per_minute:
            wait = 60 - (now - window[0])
            raise RateLimited(
                f"at most {self.limits.turns_per_minute} turns a minute per key; "
                f"retry in {wait:.0f} s"
            )
        window.append(now)

    # --- feedback and GenUI events ----------------------------------------------------------

    async def feedback(
        self, principal: Principal, conversation_id: UUID | None, frame: wire.Feedback
    ) -> Turn:
        """Record feedback on a completed turn of this tenant's conversation."""
        conversation, turn = await self._turn(principal, conversation_id, frame.turn_id)
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
            await self._append(conversation, [payload], correlation_id=turn.turn_id)
        return turn

    async def ui_event_turn(
        self, principal: Principal, conversation_id: UUID | None, frame: wire.UIEvent
    ) -> TurnRequest:
        """The harness input a GenUI interaction becomes: a turn of kind ``ui_event``."""
        _, turn = await self._turn(principal, conversation_id, frame.turn_id)
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

    async def _turn(
        self, principal: Principal, conversation_id: UUID | None, turn_id: UUID
    ) -> tuple[Conversation, Turn]:
        if conversation_id is None:
            raise TurnNotFound(f"no turn {turn_id}: start or resume a conversation first")
        conversation = await self.conversation(principal, conversation_id)
        turn = conversation.turns.get(turn_id)
        if turn is None or turn.completed is None:
            raise TurnNotFound(f"no completed turn {turn_id} in conversation {conversation_id}")
        return conversation, turn


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
