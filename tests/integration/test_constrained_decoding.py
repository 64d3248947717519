"""Grammar-constrained decoding in the local engine on a tiny random Llama: answers valid by
construction that end when the grammar is complete, the same tokens alone as in a mixed batch,
the mask on constrained rows only, and bad schemas refused before any token."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.engine import GenerationChunk, GenerationRequest, OutputConstraint, SamplingParams
from core.errors import GrammarInvalid, GrammarUnbounded
from core.harness.actions import ToolCall
from core.harness.grammars import genui_schema, tool_call_schema
from engines.local.engine import LocalEngine
from engines.local.sequence import eos_ids
from tests.factories import make_adapter
from tests.grammar_check import in_grammar

PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["kind", "age", "tags", "ok"],
    "additionalProperties": False,
}


AGENT = OutputConstraint(kind="json_schema", json_schema=tool_call_schema(), or_text=True)
"""An agent's answer: text, or a tool call that parses."""


def constrained(schema: dict[str, Any] | None) -> OutputConstraint:
    if schema is None:
        return OutputConstraint(kind="json")
    return OutputConstraint(kind="json_schema", json_schema=schema)


def ask(
    prompt: tuple[int, ...],
    adapter: str | None,
    constraint: OutputConstraint | None,
    tokens: int = 160,
    **params: Any,
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r-{adapter}-{constraint is not None}",
        prompt=prompt,
        adapter=adapter,
        params=SamplingParams(max_tokens=tokens, **params),
        constraint=constraint,
    )


async def collect(engine: LocalEngine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


def tokens_of(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text_of(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    root = tmp_path_factory.mktemp("grammar-adapters")
    engine = LocalEngine(tiny_model)
    for seed, name in ((1, "pets@1"), (2, "tools@1")):
        folder = make_adapter(
            tiny_model, root / name.replace("@", "-"), 8, ["q_proj", "v_proj"], seed
        )
        engine.load_adapter(name, str(folder))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(engine: LocalEngine) -> tuple[int, ...]:
    return engine.chat_prompt([{"role": "user", "content": "Describe a pet as JSON."}])


def test_a_constrained_answer_is_valid_and_ends_with_its_grammar(
    engine: LocalEngine, prompt: tuple[int, ...]
) -> None:
    chunks = asyncio.run(collect(engine, ask(prompt, "pets@1", constrained(PET))))
    pet = json.loads(text_of(chunks))
    assert chunks[-1].finish_reason == "stop"
    assert pet["kind"] in ("cat", "dog", "bird") and 0 <= pet["age"] <= 30
    assert len(pet["tags"]) <= 2 and all(len(t) <= 6 for t in pet["tags"])
    assert tokens_of(chunks)[-1] in eos_ids(engine.model)  # EOS ended it, and is no text

    call = text_of(
        asyncio.run(collect(engine, ask(prompt, "tools@1", constrained(tool_call_schema()))))
    )
    ToolCall.model_validate_json(call)

    tree = asyncio.run(collect(engine, ask(prompt, None, constrained(genui_schema()), 400)))
    if tree[-1].finish_reason == "stop":  # a random model may spend its budget before the end
        assert in_grammar(genui_schema(), text_of(tree))


def test_a_grammar_ends_the_answer_even_when_eos_is_ignored(
    engine: LocalEngine, prompt: tuple[int, ...]
) -> None:
    request = ask(prompt, "pets@1", constrained(PET), 500, ignore_eos=True)
    chunks = asyncio.run(collect(engine, request))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].completion_tokens < 500
    json.loads(text_of(chunks))


def test_plain_json_is_any_value_or_is_cut_at_the_limit(
    engine: LocalEngine, prompt: tuple[int, ...]
) -> None:
    chunks = asyncio.run(collect(engine, ask(prompt, "tools@1", constrained(None), 60)))
    if chunks[-1].finish_reason == "stop":
        json.loads(text_of(chunks))
    else:
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 60


def test_a_constrained_row_gives_the_same_tokens_alone_and_in_a_mixed_batch(
    engine: LocalEngine, prompt: tuple[int, ...]
) -> None:
    other = engine.chat_prompt([{"role": "user", "content": "Write a haiku."}])
    requests = [
        ask(prompt, "pets@1", constrained(PET)),
        ask(other, "tools@1", None, 48, ignore_eos=True),
        ask(other, None, constrained(tool_call_schema())),
        ask(prompt, "pets@1", None, 48, ignore_eos=True),
        ask(prompt, None, constrained(PET), temperature=0.8, seed=7),
        ask(other, "tools@1", AGENT, 160),
    ]
    alone = [tokens_of(asyncio.run(collect(engine, r))) for r in requests]

    async def together() -> list[list[GenerationChunk]]:
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    engine.stats["max_batch"] = 0
    mixed = [tokens_of(chunks) for chunks in asyncio.run(together())]
    assert engine.stats["max_batch"] >= 3
    assert mixed == alone  # constrained rows unchanged by company, the others unmasked
    json.loads(engine.tokenizer.decode(mixed[4], skip_special_tokens=True))  # sampled, masked
    agent = engine.tokenizer.decode(mixed[5], skip_special_tokens=True)
    assert agent and not agent[0].isspace()
    if agent.startswith("{"):
        ToolCall.model_validate_json(agent)


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"type": "foo"}, GrammarInvalid),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, GrammarInvalid),
        ({"type": "array", "items": {"type": "integer"}}, GrammarUnbounded),
        ({"type": "object", "properties": {"name": {"type": "string"}}}, GrammarUnbounded),
    ],
)
def test_bad_schemas_are_refused_before_any_token(
    engine: LocalEngine, prompt: tuple[int, ...], schema: dict[str, Any], error: type[Exception]
) -> None:
    async def first() -> GenerationChunk:
        return await anext(engine.generate(ask(prompt, "pets@1", constrained(schema))))

    with pytest.raises(error):
        asyncio.run(first())
    chunks = asyncio.run(collect(engine, ask(prompt, "pets@1", constrained(PET))))
    assert chunks[-1].finish_reason == "stop"  # the engine goes on
