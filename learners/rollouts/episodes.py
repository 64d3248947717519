"""Episodes of a rollout: a ``Sampler`` generates one specialist's answers from one release on
one engine, running the tools it calls in a fresh tool state (``ROLLOUT_MAX_STEPS`` steps at
most), under the harness with the specialist's output grammar enforced; a ``Group`` is one
environment's episodes with their verdicts."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import JsonValue

from core.conversation import empty_tool_state
from core.engine import Engine, GenerationRequest, SamplingParams
from core.events import ChatMessage, RolloutStep
from core.harness.actions import execute
from core.harness.artifact import HarnessSpec, HarnessVersion
from core.harness.grammars import held_to, output_constraint
from core.harness.hcp import build_context, tool_call_of
from core.merge_patch import apply_merge_patch
from core.tasks import ToolCallChecker
from learners.rollouts.environments import Environment, Verdict

ROLLOUT_MAX_STEPS = 2
"""Steps of one episode: a tool call and, after its result, the answer."""
_EPISODE_TIME = datetime(2026, 1, 1, tzinfo=UTC)
"""The clock tools see in an episode: fixed, so an episode replays alike."""


@dataclass(frozen=True)
class Group:
    """One environment's samples and their verdicts."""

    environment: Environment
    second_look: bool
    """Sampled again, with help (a hint or a sweep), because no first sample passed."""
    hint: str | None
    first_calls: list[str | None]
    """Per sample, the kind of call a sweep held its first step to (``None``: not swept)."""
    temperature: float
    episodes: list[list[RolloutStep]]
    verdicts: list[Verdict]
    round: int = 0
    """The round of adaptive sampling it was drawn in: 0, or later when the rounds before it
    had no signal and no pass (``RolloutJob.budget``)."""

    @property
    def any_passed(self) -> bool:
        return any(v.passed for v in self.verdicts)

    @property
    def has_signal(self) -> bool:
        """Whether its verified rewards differ (a group scored all alike has no advantage)."""
        return len({v.reward for v in self.verdicts if v.reward is not None}) > 1


@dataclass(frozen=True)
class Sampler:
    """Samples episodes of one specialist from one release on one engine."""

    engine: Engine
    harness: HarnessVersion
    specialist: str
    adapter: str | None
    temperature: float
    max_tokens: int

    def grammar(self, tool_required: bool, only: str | None = None) -> HarnessSpec:
        """The harness with the specialist's output grammar enforced (a tool call or a GenUI
        tree is well-formed by construction, so the reward measures content), where the
        environment's verifier judges a tool call, a tool call required as the first step
        and, with ``only``, that kind of call (``call_kinds``: a tool, or one op of it) the
        only one the decoder lets it make (a sweep: the model is still told of every tool)."""
        spec = self.harness.spec
        update: dict[str, Any] = {"enforce_grammar": True}
        if tool_required:
            update["tool_choice"] = "required"
        own = spec.for_specialist(self.specialist).model_copy(update=update)
        grammar: dict[str, Any] = {"specialists": {**spec.specialists, self.specialist: own}}
        if only is not None:
            grammar["tools"] = held_to(spec.tools, only)
        return spec.model_copy(update=grammar)

    async def episode(
        self,
        environment: Environment,
        hint: str | None,
        seed: int,
        slots: asyncio.Semaphore,
        first_call: str | None = None,
    ) -> list[RolloutStep]:
        """Generate, run the tool the model calls in a fresh tool state and show it the result,
        until it answers in text or the episode has used its steps; with ``first_call``, the
        first step makes that kind of call."""
        user = environment.task.prompt if hint is None else f"{environment.task.prompt}\n\n{hint}"
        context = build_context(self.harness, self.specialist, [], user)
        required = isinstance(environment.task.checker, ToolCallChecker)
        first, grammar = self.grammar(required, first_call), self.grammar(required)
        state = empty_tool_state()
        steps: list[RolloutStep] = []
        scratch: list[ChatMessage] = []
        for n in range(ROLLOUT_MAX_STEPS):
            messages = context.model_copy(update={"scratch": tuple(scratch)}).messages()
            async with slots:
                step_grammar = first if n == 0 else grammar
                text = await self._generate(messages, seed + n, step_grammar, first_step=n == 0)
            call = tool_call_of(text) if "tool_call" in context.grammars else None
            if call is None:
                steps.append(RolloutStep(output=text))
                break
            done = execute(call, state, _EPISODE_TIME)
            state = apply_merge_patch(state, done.state_delta)
            action: dict[str, JsonValue] = {
                "name": done.name,
                "args": done.args,
                "result": done.result,
                "ok": done.ok,
            }
            steps.append(RolloutStep(output=text, action=action))
            scratch.append(ChatMessage(role="assistant", content=text.strip()))
            result = json.dumps({"tool": done.name, "ok": done.ok, "result": done.result})
            scratch.append(ChatMessage(role="user", content=f"Tool result: {result}"))
        return steps

    async def _generate(
        self, messages: list[dict[str, str]], seed: int, grammar: HarnessSpec, *, first_step: bool
    ) -> str:
        request = GenerationRequest(
            request_id=f"rollout-{seed}",
            prompt=self.engine.chat_prompt(messages),
            adapter=self.adapter,
            params=SamplingParams(
                temperature=self.temperature, seed=seed, max_tokens=self.max_tokens
            ),
            constraint=output_constraint(grammar, self.specialist, first_step=first_step),
        )
        return "".join([chunk.text async for chunk in self.engine.generate(request)])
