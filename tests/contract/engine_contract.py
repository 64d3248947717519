"""The one contract every ``Engine`` passes, unchanged: the local engine and the vLLM fleet.

Subclasses provide the ``engine`` fixture (a fresh engine, no adapters loaded) and
``model_dir`` (the base model it serves, for making adapters that fit it).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from core.engine import Engine, GenerationChunk, GenerationRequest, OutputConstraint, SamplingParams
from core.errors import (
    AdapterInvalid,
    AdapterNotFound,
    AdapterRankTooLarge,
    EngineUnavailable,
    GrammarInvalid,
    GrammarUnbounded,
)
from core.harness.actions import TOOLS, ToolCall
from core.harness.grammars import tool_call_schema
from tests.factories import make_adapter
from tests.grammar_check import in_grammar

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def ask(adapter: str | None, prompt: tuple[int, ...], tokens: int = 8) -> GenerationRequest:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return GenerationRequest(request_id="contract", prompt=prompt, adapter=adapter, params=params)


def ask_for(adapter: str, prompt: tuple[int, ...], schema: dict[str, Any]) -> GenerationRequest:
    constraint = OutputConstraint(kind="json_schema", json_schema=schema)
    params = SamplingParams(max_tokens=120)
    return GenerationRequest(
        request_id="contract", prompt=prompt, adapter=adapter, params=params, constraint=constraint
    )


async def collect(engine: Engine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


class EngineContract:
    @pytest.fixture
    def adapters(self, model_dir: Path, tmp_path: Path) -> list[Path]:
        return [make_adapter(model_dir, tmp_path / f"a{seed}", 8, TARGETS, seed) for seed in (1, 2)]

    def prompt(self, engine: Engine) -> tuple[int, ...]:
        return engine.chat_prompt([{"role": "user", "content": "Name three colours."}])

    def test_a_chat_prompt_is_token_ids(self, engine: Engine) -> None:
        prompt = self.prompt(engine)
        assert prompt and all(isinstance(t, int) and t >= 0 for t in prompt)

    @pytest.mark.numeric
    def test_greedy_answers_stream_and_repeat(self, engine: Engine, adapters: list[Path]) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        assert engine.loaded_adapters() == ["contract@1"]
        prompt = self.prompt(engine)
        first = asyncio.run(collect(engine, ask("contract@1", prompt)))
        again = asyncio.run(collect(engine, ask("contract@1", prompt)))
        tokens = [t for c in first for t in c.token_ids]
        assert len(tokens) == 8 and tokens == [t for c in again for t in c.token_ids]
        assert [c.finish_reason for c in first] == [None] * (len(first) - 1) + ["length"]
        assert first[-1].completion_tokens == 8 and first[-1].prompt_tokens == len(prompt)
        assert {c.request_id for c in first} == {"contract"}

    @pytest.mark.numeric
    def test_each_adapter_is_its_own(self, engine: Engine, adapters: list[Path]) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        engine.load_adapter("contract@2", str(adapters[1]))
        engine.load_adapter("contract@1", str(adapters[0]))  # loaded once is loaded
        assert sorted(engine.loaded_adapters()) == ["contract@1", "contract@2"]
        prompt = self.prompt(engine)

        async def both() -> list[list[GenerationChunk]]:
            return await asyncio.gather(
                *(collect(engine, ask(n, prompt, 12)) for n in ("contract@1", "contract@2"))
            )

        one, two = ([t for c in chunks for t in c.token_ids] for chunks in asyncio.run(both()))
        assert one != two

    def test_adapter_errors_are_typed(
        self, engine: Engine, model_dir: Path, adapters: list[Path], tmp_path: Path
    ) -> None:
        prompt = self.prompt(engine)
        with pytest.raises(AdapterNotFound):
            asyncio.run(collect(engine, ask("contract@9", prompt)))
        with pytest.raises(AdapterInvalid, match="versioned adapter name"):
            engine.load_adapter("Contract", str(adapters[0]))
        with pytest.raises(AdapterInvalid):
            engine.load_adapter("contract@3", str(tmp_path / "nothing-here"))
        huge = make_adapter(model_dir, tmp_path / "huge", 128, ["q_proj"], 3)
        with pytest.raises(AdapterRankTooLarge) as refused:
            engine.load_adapter("contract@4", str(huge))
        assert refused.value.code == "adapter_rank_too_large"
        assert engine.loaded_adapters() == []

    def test_unloading_drains_requests_in_flight(
        self, engine: Engine, adapters: list[Path]
    ) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        prompt = self.prompt(engine)

        async def unload_mid_answer() -> list[GenerationChunk]:
            got: list[GenerationChunk] = []
            async for chunk in engine.generate(ask("contract@1", prompt, 24)):
                if not got:
                    engine.unload_adapter("contract@1")
                got.append(chunk)
            return got

        chunks = asyncio.run(unload_mid_answer())
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 24
        assert engine.loaded_adapters() == []
        with pytest.raises(AdapterNotFound):
            asyncio.run(collect(engine, ask("contract@1", prompt)))
        with pytest.raises(AdapterNotFound):
            engine.unload_adapter("contract@1")

    def test_closing_the_stream_cancels_and_the_engine_goes_on(
        self, engine: Engine, adapters: list[Path]
    ) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        prompt = self.prompt(engine)

        async def first_chunk_only() -> GenerationChunk:
            stream = engine.generate(ask("contract@1", prompt, 2000))
            chunk = await anext(stream)
            await stream.aclose()
            return chunk

        assert asyncio.run(first_chunk_only()).finish_reason is None
        chunks = asyncio.run(collect(engine, ask("contract@1", prompt)))
        assert chunks[-1].completion_tokens == 8

    def test_a_constrained_answer_is_a_valid_tool_call(
        self, engine: Engine, adapters: list[Path]
    ) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        prompt = self.prompt(engine)
        chunks = asyncio.run(collect(engine, ask_for("contract@1", prompt, tool_call_schema())))
        assert chunks[-1].finish_reason == "stop"
        text = "".join(c.text for c in chunks)
        assert in_grammar(tool_call_schema(), text)  # rules across arguments are the tool's
        assert ToolCall.model_validate_json(text).tool in {tool.name for tool in TOOLS}

    def test_bad_and_unbounded_schemas_are_typed_errors(
        self, engine: Engine, adapters: list[Path]
    ) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        prompt = self.prompt(engine)
        with pytest.raises(GrammarInvalid) as invalid:
            asyncio.run(collect(engine, ask_for("contract@1", prompt, {"type": "foo"})))
        assert invalid.value.code == "grammar_invalid"
        unbounded = {"type": "object", "properties": {"tags": {"type": "array"}}}
        with pytest.raises(GrammarUnbounded) as loose:
            asyncio.run(collect(engine, ask_for("contract@1", prompt, unbounded)))
        assert loose.value.code == "grammar_unbounded"

    def test_a_closed_engine_takes_no_requests(self, engine: Engine, adapters: list[Path]) -> None:
        engine.load_adapter("contract@1", str(adapters[0]))
        engine.close()
        with pytest.raises(EngineUnavailable):
            asyncio.run(collect(engine, ask("contract@1", self.prompt(engine))))
