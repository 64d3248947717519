"""One generation step of a turn: the engine's stream, passed on as tokens with hold-back.

Text is streamed as it comes, unless the answer may be JSON (a tool call or a GenUI tree): that
is held back until it can be judged whole, so a tool call is never shown to the user as text.
"""

from __future__ import annotations

import asyncio
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
from core.release import AdapterRef
from infra import observe
from server import protocol as wire
from server.turns.request import Sink, TurnOutcome


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


@dataclass
class _Timing:
    submitted: float
    first_token: float | None = None
    tokens: int = 0


async def generate(
    engine: Engine,
    sampling: SamplingParams,
    constraint: OutputConstraint | None,
    context: HarnessContext,
    adapter: AdapterRef,
    outcome: TurnOutcome,
    step: int,
    sink: Sink,
    cancel: asyncio.Event,
) -> str:
    """Run step ``step`` of a turn under ``constraint`` (if any), streaming what hold-back
    allows to ``sink``; returns the text. The sampling seed is the client's seed, else the turn
    id, plus the step, so a rerun of the turn samples alike."""
    seed = outcome.turn_id.int if sampling.seed is None else sampling.seed
    request = GenerationRequest(
        request_id=f"{outcome.turn_id}.{step}",
        prompt=engine.chat_prompt(context.messages()),
        adapter=adapter.name,
        params=sampling.model_copy(update={"seed": (seed + step) % 2**63}),
        constraint=constraint,
    )
    holdback = HoldBack(context.grammars)
    timing = _Timing(time.monotonic())
    chunks = engine.generate(request)
    observe.engine_in_flight.add(1)
    with observe.tracer.start_as_current_span(
        "engine.generate", attributes={"macaron.adapter": adapter.name, "macaron.step": step}
    ) as span:
        try:
            text = await _stream(chunks, outcome, holdback, timing, sink, cancel)
        finally:
            await chunks.aclose()
            _observe(span, timing, adapter.name, step, outcome.finish_reason)
    released = holdback.released(text)
    if released:
        await sink(wire.Token(turn_id=outcome.turn_id, delta=released))
    return text


async def _stream(
    chunks: AsyncGenerator[GenerationChunk, None],
    outcome: TurnOutcome,
    holdback: HoldBack,
    timing: _Timing,
    sink: Sink,
    cancel: asyncio.Event,
) -> str:
    text = ""
    async for chunk in chunks:
        if timing.first_token is None and chunk.text:
            timing.first_token = time.monotonic() - timing.submitted
        text += chunk.text
        outcome.prompt_tokens = max(outcome.prompt_tokens, chunk.prompt_tokens)
        if chunk.finish_reason is not None:
            timing.tokens = chunk.completion_tokens
            outcome.completion_tokens += chunk.completion_tokens
            outcome.finish_reason = chunk.finish_reason
        if cancel.is_set():
            outcome.finish_reason = "cancelled"
            break
        delta = holdback.delta(text)
        if delta:
            await sink(wire.Token(turn_id=outcome.turn_id, delta=delta))
    return text


def _observe(span: Span, timing: _Timing, adapter: str, step: int, finish_reason: str) -> None:
    observe.engine_in_flight.add(-1)
    observe.tokens.add(timing.tokens, {"adapter": adapter})
    if timing.first_token is not None:
        span.set_attribute("macaron.time_to_first_token_ms", timing.first_token * 1000)
        if step == 0:
            observe.time_to_first_token.record(timing.first_token)
    span.set_attributes({"macaron.tokens": timing.tokens, "macaron.finish_reason": finish_reason})
