"""The agent loop of a turn: generate, run the tool the model calls, give it the result, and
generate again, until the model answers in text or the turn has used its actions."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

from core.engine import Engine, SamplingParams
from core.events import ChatMessage, HarnessActionExecuted, HarnessStamp, RequestedDecoding
from core.harness.actions import MAX_ACTIONS_PER_TURN, ToolCall, execute
from core.harness.artifact import Decoding
from core.harness.genui import parse_genui_output
from core.harness.grammars import output_constraint
from core.harness.hcp import HarnessContext, tool_call_of
from core.ids import uuid7
from infra import observe
from server.turns.active import ActiveTurn
from server.turns.conversations import ConversationStore
from server.turns.generation import Step, generate
from server.turns.items import ActionDone, TextDelta
from server.turns.request import ChatLimits, client_constraint


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

    async def answer(self, turn: ActiveTurn, context: HarnessContext) -> None:
        """Fill ``turn.outcome`` with the turn's answer, each step sampled as its harness says
        for its specialist (or as the client asked) and decoded under the grammar it enforces,
        if any. Actions wait for the turn's receipt, so the log's order is the turn's order."""
        route, outcome = turn.route, turn.outcome
        harness, specialist = route.harness.spec, route.specialist
        scratch: list[ChatMessage] = []
        asked = turn.call.request.decoding or RequestedDecoding()
        sampling = _sampling(harness.for_specialist(specialist).decoding, asked, self._limits())
        client = client_constraint(asked)  # the client's format: no tool runs, no GenUI
        for index in range(MAX_ACTIONS_PER_TURN + 1):
            step = Step(
                index,
                context.model_copy(update={"scratch": tuple(scratch)}),
                sampling,
                client or output_constraint(harness, specialist, first_step=index == 0),
            )
            text = await generate(self.engine, turn, step)
            acts = client is None and "tool_call" in context.grammars
            call = tool_call_of(text) if acts else None
            if call is None or outcome.finish_reason == "cancelled":
                break
            if index == MAX_ACTIONS_PER_TURN:
                outcome.text = f"I stopped after {MAX_ACTIONS_PER_TURN} actions in one turn."
                await turn.emit(TextDelta(turn_id=turn.turn_id, delta=outcome.text))
                return
            await turn.receipt
            done = await self._act(turn, call, context)
            result = json.dumps({"tool": done.name, "ok": done.ok, "result": done.result})
            scratch.append(ChatMessage(role="assistant", content=text.strip()))
            scratch.append(ChatMessage(role="user", content=f"Tool result: {result}"))
        outcome.text = text
        if client is None and "genui" in context.grammars and outcome.finish_reason != "cancelled":
            outcome.genui = parse_genui_output(text)

    async def _act(
        self, turn: ActiveTurn, call: ToolCall, context: HarnessContext
    ) -> HarnessActionExecuted:
        """Run one tool call in the action substrate, record it, and show it to the client."""
        now = self._clock()
        with observe.tracer.start_as_current_span("harness.action") as span:
            done = execute(call, turn.conversation.tool_state, now)
            span.set_attributes({"macaron.tool": done.name, "macaron.ok": done.ok})
        action = HarnessActionExecuted(
            turn_id=turn.turn_id,
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
        await self._store.append(turn.conversation, [action], correlation_id=turn.turn_id, at=now)
        turn.outcome.actions.append(action)
        await turn.emit(
            ActionDone(
                turn_id=turn.turn_id,
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
