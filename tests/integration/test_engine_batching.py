"""The local engine's prompt passes on a tiny random Llama: prompts of different lengths and
adapters computed in one pass, and a long prompt computed in chunks, give PEFT's answers; a
long prompt does not hold up an answer already streaming; samples of one prompt sent together
fork one prompt pass; streamed text is the whole decode, however the characters split across
tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine import GenerationChunk, GenerationRequest, SamplingParams
from engines.local.detok import IncrementalText
from engines.local.engine import LocalEngine
from engines.local.limits import EngineLimits
from tests.factories import make_adapter
from tests.integration.test_local_engine import collect, peft_greedy, tokens

PROMPTS = [
    "Hi",
    "Write a function that adds two numbers and explain it.",
    "Show me a form with a name field, an email field and a submit button, please. " * 3,
]


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters") / "coding-1"
    return make_adapter(tiny_model, folder, 8, ["q_proj", "v_proj", "up_proj", "down_proj"], 5)


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_prefix_cache_bytes=0))
    yield engine
    engine.close()


def request(
    engine: LocalEngine, text: str, adapter: str | None = None, **params: object
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{random.random()}",
        prompt=tuple(engine.encode(text)),
        adapter=adapter,
        params=SamplingParams.model_validate({"max_tokens": 10, **params}),
    )


def run_together(engine: LocalEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def run() -> list[list[GenerationChunk]]:
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    return [tokens(chunks) for chunks in asyncio.run(run())]


def prompt_of(r: GenerationRequest) -> list[int]:
    assert isinstance(r.prompt, tuple)
    return list(r.prompt)


@pytest.mark.numeric
def test_prompts_of_different_lengths_and_adapters_share_a_pass(
    engine: LocalEngine, tiny_model: Path, adapter: Path
) -> None:
    engine.load_adapter("coding@1", str(adapter))
    plan = [(p, a) for p in PROMPTS for a in (None, "coding@1")]
    requests = [request(engine, p, a) for p, a in plan]
    answers = run_together(engine, requests)
    assert engine.stats["prefill_passes"] < len(requests), "every prompt had a pass of its own"
    assert engine.stats["prefill_tokens"] == sum(len(prompt_of(r)) for r in requests)
    for r, (_, name), got in zip(requests, plan, answers, strict=True):
        folder = adapter if name else None
        assert got == peft_greedy(tiny_model, folder, prompt_of(r), 10), (name, r.prompt)


@pytest.mark.numeric
def test_a_prompt_computed_in_chunks_gives_the_whole_answer(
    tiny_model: Path, adapter: Path
) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(prefill_budget=16))
    try:
        engine.load_adapter("coding@1", str(adapter))
        long = request(engine, PROMPTS[2], "coding@1")
        assert len(prompt_of(long)) > 3 * 16
        assert run_together(engine, [long]) == [
            peft_greedy(tiny_model, adapter, prompt_of(long), 10)
        ]
        assert engine.stats["prefill_passes"] == -(-len(prompt_of(long)) // 16)
    finally:
        engine.close()


def test_a_long_prompt_does_not_hold_up_a_streaming_answer(tiny_model: Path) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(prefill_budget=8))
    try:
        short = request(engine, PROMPTS[0], max_tokens=6, ignore_eos=True)
        long = request(engine, PROMPTS[2] * 2, max_tokens=2, ignore_eos=True)
        assert len(prompt_of(long)) > 10 * 8  # ten passes at least, the short answer needs 5 steps
        order: list[str] = []

        async def run() -> None:
            stream = engine.generate(short)
            await anext(stream)  # the short answer is streaming before the long prompt comes

            async def drain(name: str, chunks: object) -> None:
                async for chunk in chunks:  # type: ignore[attr-defined]
                    order.append(f"{name}:{chunk.completion_tokens}")

            await asyncio.gather(drain("short", stream), drain("long", engine.generate(long)))

        asyncio.run(run())
        assert order.index("short:6") < order.index("long:1"), order
    finally:
        engine.close()


@pytest.mark.numeric
def test_samples_sent_together_fork_one_prompt_pass(engine: LocalEngine) -> None:
    samples = [
        request(engine, PROMPTS[1], seed=seed, temperature=1.0, top_p=0.9, max_tokens=40)
        for seed in range(4)
    ]
    together = run_together(engine, samples)
    assert engine.stats["forks"] == 3
    assert engine.stats["prefill_tokens"] == len(prompt_of(samples[0]))
    alone = [run_together(engine, [s])[0] for s in samples]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1, "the seeds did not make the samples differ"


@pytest.mark.numeric
def test_a_request_forks_one_already_answering(engine: LocalEngine) -> None:
    first, second = (request(engine, PROMPTS[2], max_tokens=30) for _ in range(2))

    async def run() -> tuple[list[int], list[int]]:
        stream = engine.generate(first)
        head = await anext(stream)  # the first is answering when the second comes
        later = asyncio.ensure_future(collect(engine, second))
        return [*head.token_ids, *tokens([c async for c in stream])], tokens(await later)

    one, two = asyncio.run(run())
    assert one == two == run_together(engine, [first])[0]
    assert engine.stats["forks"] == 1
    assert engine.stats["prefill_tokens"] == 2 * len(prompt_of(first))  # the last run's too


@pytest.mark.numeric
def test_a_request_forks_a_fork(engine: LocalEngine) -> None:
    short, long, later = (request(engine, PROMPTS[2], max_tokens=n) for n in (2, 40, 12))

    async def run() -> list[int]:
        first = asyncio.ensure_future(collect(engine, short))
        await asyncio.sleep(0)  # the short one is queued first
        stream = engine.generate(long)
        await anext(stream)  # answering: it forked the short one's prompt
        await first  # the short one is done: only the fork answers now
        third = tokens(await collect(engine, later))  # forks the fork
        async for _ in stream:
            pass
        return third

    got = asyncio.run(run())
    assert engine.stats["forks"] == 2
    assert engine.stats["prefill_tokens"] == len(prompt_of(short))
    assert got == run_together(engine, [later])[0]


@pytest.mark.numeric
def test_a_fork_on_other_adapter_weights_is_not_a_fork(
    engine: LocalEngine, tiny_model: Path, adapter: Path
) -> None:
    engine.load_adapter("coding@1", str(adapter))
    both = [request(engine, PROMPTS[1]), request(engine, PROMPTS[1], "coding@1")]
    answers = run_together(engine, both)
    assert engine.stats["forks"] == 0
    assert answers[1] == peft_greedy(tiny_model, adapter, prompt_of(both[1]), 10)
    assert answers[0] != answers[1]


def test_streamed_text_is_the_whole_decode(engine: LocalEngine) -> None:
    tokenizer = engine.tokenizer
    texts = ["Héllo wörld! 日本語 🎉🎉 def f(x):\n    return x  ,  . ok", "a\tb  c ‽ ∑"]
    rng = random.Random(7)
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(50)]
    for ids in sequences:
        text = IncrementalText(tokenizer)
        streamed = "".join(text.append(t) for t in ids)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert text.flush() == whole
        assert whole.startswith(streamed) and "\ufffd" not in streamed[-1:]
