"""One generation step of a turn: the engine's stream, passed on as tokens with hold-back.

Text is streamed as it comes, unless the answer may be JSON (a tool call or a GenUI tree): that
is held back until it can be judged whole, so a tool call is never shown to the user as text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from opentelemetry.trace import Span

from core.engine import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    SamplingParams,
)
from core.harness.artifact import OutputKind
from core.harness.hcp import HarnessContext, looks_structured, tool_call_of
from infra import observe
from server.turns.active import ActiveTurn
from server.turns.items import TextDelta


class HoldBack:
    """What of a growing answer may be shown yet. A GenUI answer is held whole; an agent's is
    held from its first visible character if it looks like JSON, else streamed."""

    def __init__(self, grammars: tuple[OutputKind, ...]) -> None:
        self.genui = "genui" in grammars
        self.hold = self.genui
        self.undecided = "tool_call" in grammars
        self.sent = 0

    def delta(self, text: str) -> str:
        """The part of ``text`` to stream now (empty while held back)."""
        if self.undecided and text.strip():
            self.hold, self.undecided = looks_structured(text), False
        if self.hold or self.undecided or len(text) <= self.sent:
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta

    def released(self, text: str) -> str:
        """At the end: held-back JSON that is not a tool call is the answer after all."""
        if self.hold and not self.genui and tool_call_of(text) is None:
            return text
        return ""


@dataclass(frozen=True)
class Step:
    """One generation step of a turn: its index, its context (with the agent's scratch so far),
    and how it is sampled and constrained."""

    index: int
    context: HarnessContext
    sampling: SamplingParams
    constraint: OutputConstraint | None


@dataclass
class _Timing:
    submitted: float
    first_token: float | None = None
    tokens: int = 0


async def generate(engine: Engine, turn: ActiveTurn, step: Step) -> str:
    """Run ``step`` of ``turn``, streaming what hold-back allows; returns the text. The sampling
    seed is the client's seed, else the turn id, plus the step, so a rerun of the turn samples
    alike."""
    sampling, adapter = step.sampling, turn.route.adapter.name
    seed = turn.turn_id.int if sampling.seed is None else sampling.seed
    request = GenerationRequest(
        request_id=f"{turn.turn_id}.{step.index}",
        prompt=engine.chat_prompt(step.context.messages()),
        adapter=adapter,
        params=sampling.model_copy(update={"seed": (seed + step.index) % 2**63}),
        constraint=step.constraint,
    )
    holdback = HoldBack(step.context.grammars)
    timing = _Timing(time.monotonic())
    chunks = engine.generate(request)
    observe.engine_in_flight.add(1)
    with observe.tracer.start_as_current_span(
        "engine.generate", attributes={"macaron.adapter": adapter, "macaron.step": step.index}
    ) as span:
        try:
            text = await _stream(chunks, turn, holdback, timing)
        finally:
            await chunks.aclose()
            _observe(span, timing, turn, step.index)
    released = holdback.released(text)
    if released:
        await turn.emit(TextDelta(turn_id=turn.turn_id, delta=released))
    return text


async def _stream(
    chunks: AsyncGenerator[GenerationChunk, None],
    turn: ActiveTurn,
    holdback: HoldBack,
    timing: _Timing,
) -> str:
    text, outcome = "", turn.outcome
    async for chunk in chunks:
        if timing.first_token is None and chunk.text:
            timing.first_token = time.monotonic() - timing.submitted
        text += chunk.text
        outcome.prompt_tokens = max(outcome.prompt_tokens, chunk.prompt_tokens)
        if chunk.finish_reason is not None:
            timing.tokens = chunk.completion_tokens
            outcome.completion_tokens += chunk.completion_tokens
            outcome.finish_reason = chunk.finish_reason
        if turn.cancelled:
            outcome.finish_reason = "cancelled"
            break
        delta = holdback.delta(text)
        if delta:
            await turn.emit(TextDelta(turn_id=turn.turn_id, delta=delta))
    return text


def _observe(span: Span, timing: _Timing, turn: ActiveTurn, step: int) -> None:
    observe.engine_in_flight.add(-1)
    observe.tokens.add(timing.tokens, {"adapter": turn.route.adapter.name})
    if timing.first_token is not None:
        span.set_attribute("macaron.time_to_first_token_ms", timing.first_token * 1000)
        if step == 0:
            observe.time_to_first_token.record(timing.first_token)
    finish_reason = turn.outcome.finish_reason
    span.set_attributes({"macaron.tokens": timing.tokens, "macaron.finish_reason": finish_reason})
