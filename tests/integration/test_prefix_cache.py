"""The local engine's prefix cache and KV buffers on a tiny random Llama: an answer that begins
from a cached prefix is the answer computed whole; samples of one prompt share its prefill;
unloading an adapter drops its prefixes; the cache stays within its cap and counts evictions;
an answer longer than its cache's first buffer is PEFT's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine import GenerationRequest, SamplingParams
from engines.local.engine import LocalEngine
from engines.local.kv_pool import GROWTH_RESERVE
from engines.local.limits import EngineLimits
from engines.local.prefixes import MIN_PREFIX_TOKENS
from tests.factories import make_adapter
from tests.integration.test_local_engine import collect, peft_greedy, tokens

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 3
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Hello!"]


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters") / "genui-1"
    return make_adapter(tiny_model, folder, 8, ["q_proj", "k_proj", "v_proj", "up_proj"], 3)


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(tiny_model)
    yield engine
    engine.close()


@pytest.fixture
def uncached(tiny_model: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_prefix_cache_bytes=0))
    yield engine
    engine.close()


def prompts(engine: LocalEngine) -> list[tuple[int, ...]]:
    return [system_ids(engine) + tuple(engine.encode(q)) for q in QUESTIONS]


def system_ids(engine: LocalEngine) -> tuple[int, ...]:
    ids = tuple(engine.encode(SYSTEM))
    assert len(ids) > MIN_PREFIX_TOKENS
    return ids


def answer(
    engine: LocalEngine, prompt: tuple[int, ...], adapter: str | None = None, **params: object
) -> list[int]:
    request = GenerationRequest(
        request_id="r",
        prompt=prompt,
        adapter=adapter,
        params=SamplingParams.model_validate({"max_tokens": 12, **params}),
    )
    return tokens(asyncio.run(collect(engine, request)))


@pytest.mark.numeric
def test_an_answer_from_a_cached_prefix_is_the_answer_computed_whole(
    engine: LocalEngine, uncached: LocalEngine, adapter: Path
) -> None:
    for e in (engine, uncached):
        e.load_adapter("genui@1", str(adapter))
    for name in (None, "genui@1"):
        for prompt in prompts(engine):
            assert answer(engine, prompt, name) == answer(uncached, prompt, name)
    system = len(system_ids(engine))
    # per adapter, the first prompt computes the system prompt and the three others reuse it
    assert engine.prefixes.stats["hits"] == 6
    assert engine.prefixes.stats["tokens_reused"] >= 6 * system
    assert uncached.prefixes.stats["hits"] == 0


@pytest.mark.numeric
def test_an_adapter_never_reuses_the_base_models_prefix(
    engine: LocalEngine, tiny_model: Path, adapter: Path
) -> None:
    prompt = prompts(engine)[0]
    answer(engine, prompt)
    engine.load_adapter("genui@1", str(adapter))
    assert answer(engine, prompt, "genui@1") == peft_greedy(tiny_model, adapter, list(prompt), 12)
    assert engine.prefixes.stats["hits"] == 0


@pytest.mark.numeric
def test_samples_of_one_prompt_share_its_prefill(
    engine: LocalEngine, uncached: LocalEngine
) -> None:
    prompt = prompts(engine)[1]
    first = [answer(engine, prompt, seed=seed, temperature=1.0, top_p=0.9) for seed in range(4)]
    again = [answer(uncached, prompt, seed=seed, temperature=1.0, top_p=0.9) for seed in range(4)]
    assert first == again
    assert engine.prefixes.stats["hits"] == 3
    assert engine.prefixes.stats["tokens_reused"] == 3 * (len(prompt) - 1)
    assert engine.prefixes.stats["entries"] == 1


@pytest.mark.numeric
def test_unloading_an_adapter_drops_its_prefixes(
    engine: LocalEngine, tiny_model: Path, adapter: Path, tmp_path: Path
) -> None:
    prompt = prompts(engine)[2]
    engine.load_adapter("genui@1", str(adapter))
    answer(engine, prompt, "genui@1")
    answer(engine, prompt)
    assert engine.prefixes.stats["entries"] == 2
    engine.unload_adapter("genui@1")
    assert engine.prefixes.stats["entries"] == 1
    other = make_adapter(tiny_model, tmp_path / "other", 8, ["k_proj", "v_proj"], 7)
    engine.load_adapter("genui@1", str(other))
    assert answer(engine, prompt, "genui@1") == peft_greedy(tiny_model, other, list(prompt), 12)


def test_the_cache_stays_within_its_cap_and_counts_evictions(tiny_model: Path) -> None:
    probe = LocalEngine(tiny_model)
    try:
        distinct = [tuple(probe.encode(f"{n} " * 30 + "Hello!")) for n in range(5)]
        assert len({len(p) for p in distinct}) == 1
        answer(probe, distinct[0])
        one_entry = probe.prefixes.stats["bytes"]
    finally:
        probe.close()
    cap = int(2.5 * one_entry)
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_prefix_cache_bytes=cap))
    try:
        for prompt in distinct:
            answer(engine, prompt)
        stats = engine.prefixes.stats
        assert stats["bytes"] <= cap
        assert stats["entries"] == 2
        assert stats["evictions"] == len(distinct) - 2
    finally:
        engine.close()


@pytest.mark.numeric
def test_an_answer_longer_than_the_first_kv_buffer_is_pefts(
    engine: LocalEngine, tiny_model: Path
) -> None:
    prompt = tuple(engine.encode("Tell me a long story about a dragon."))
    n = GROWTH_RESERVE + 40  # the pool grows on the way
    assert answer(engine, prompt, max_tokens=n, ignore_eos=True) == peft_greedy(
        tiny_model, None, list(prompt), n
    )
