"""The agent loop of a turn: generate, run the tool the model calls, give it the result, and
generate again, until the model answers in text or the turn has used its actions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import datetime

from core.conversation import Conversation
from core.engine import Engine, SamplingParams
from core.events import ChatMessage, HarnessActionExecuted, HarnessStamp, RequestedDecoding
from core.harness.actions import MAX_ACTIONS_PER_TURN, ToolCall, execute
from core.harness.artifact import Decoding, HarnessSpec
from core.harness.genui import parse_genui_output
from core.harness.grammars import output_constraint
from core.harness.hcp import HarnessContext, tool_call_of
from core.ids import uuid7
from core.release import AdapterRef
from infra import observe
from server import protocol as wire
from server.turns.conversations import ConversationStore
from server.turns.generation import generate
from server.turns.request import ChatLimits, Sink, TurnOutcome, client_constraint


class AgentLoop:
    def __init__(
        self,
        engine: Engine,
        store: ConversationStore,
        limits: Callable[[], ChatLimits],
        clock: Callable[[], datetime],
    ) -> None:
        self.engine = engine
        self._store = store
        self._limits = limits
        self._clock = clock

    async def answer(
        self,
        conversation: Conversation,
        context: HarnessContext,
        adapter: AdapterRef,
        harness: HarnessSpec,
        specialist: str,
        requested: RequestedDecoding | None,
        outcome: TurnOutcome,
        sink: Sink,
        cancel: asyncio.Event,
        receipt: asyncio.Task[None],
    ) -> None:
        """Fill ``outcome`` with the turn's answer, each step sampled as ``harness`` says for
        ``specialist`` (or as the client ``requested``) and decoded under the grammar it
        enforces, if any. Actions wait for ``receipt`` (the turn's first events), so the log's
        order is the turn's order."""
        scratch: list[ChatMessage] = []
        asked = requested or RequestedDecoding()
        sampling = _sampling(harness.for_specialist(specialist).decoding, asked, self._limits())
        client = client_constraint(asked)  # the client's format: no tool runs, no GenUI
        for step in range(MAX_ACTIONS_PER_TURN + 1):
            step_context = context.model_copy(update={"scratch": tuple(scratch)})
            text = await generate(
                self.engine,
                sampling,
                client or output_constraint(harness, specialist, first_step=step == 0),
                step_context,
                adapter,
                outcome,
                step,
                sink,
                cancel,
            )
            acts = client is None and "tool_call" in context.grammars
            call = tool_call_of(text) if acts else None
            if call is None or outcome.finish_reason == "cancelled":
                break
            if step == MAX_ACTIONS_PER_TURN:
                outcome.text = f"I stopped after {MAX_ACTIONS_PER_TURN} actions in one turn."
                await sink(wire.Token(turn_id=outcome.turn_id, delta=outcome.text))
                return
            await receipt
            done = await self._act(conversation, call, context, outcome, sink)
            result = json.dumps({"tool": done.name, "ok": done.ok, "result": done.result})
            scratch.append(ChatMessage(role="assistant", content=text.strip()))
            scratch.append(ChatMessage(role="user", content=f"Tool result: {result}"))
        outcome.text = text
        if client is None and "genui" in context.grammars and outcome.finish_reason != "cancelled":
            outcome.genui = parse_genui_output(text)

    async def _act(
        self,
        conversation: Conversation,
        call: ToolCall,
        context: HarnessContext,
        outcome: TurnOutcome,
        sink: Sink,
    ) -> HarnessActionExecuted:
        """Run one tool call in the action substrate, record it, and show it to the client."""
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
            harness=HarnessStamp(
                harness_version=context.harness_version, hcp_version=context.hcp_version
            ),
        )
        await self._store.append(conversation, [action], correlation_id=outcome.turn_id, at=now)
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
        return action


def _sampling(
    decoding: Decoding, requested: RequestedDecoding, limits: ChatLimits
) -> SamplingParams:
    """The turn's sampling: what the client asked, else the specialist's harness settings; the
    answer's length capped by the server's (the seed, if not asked, is the turn's)."""
    temperature = decoding.temperature if requested.temperature is None else requested.temperature
    return SamplingParams(
        max_tokens=min(requested.max_tokens or decoding.max_new_tokens, limits.max_new_tokens),
        temperature=temperature,
        top_p=requested.top_p or decoding.top_p,
        seed=requested.seed,
        stop=requested.stop,
    )
