"""The local engine on a tiny random Llama: PEFT equivalence in mixed batches, adapters at run
time, sampling controls, cancellation and back-pressure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from core.engine import GenerationChunk, GenerationRequest, SamplingParams
from core.errors import (
    AdapterCapacityExceeded,
    AdapterInvalid,
    AdapterNotFound,
    AdapterRankTooLarge,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.local.engine import LocalEngine
from engines.local.limits import EngineLimits
from tests.factories import make_adapter

ADAPTERS = {  # name: (rank, target modules, seed)
    "coding@1": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
    "agent@1": (4, ["gate_proj", "up_proj", "down_proj"], 2),
    "genui@1": (16, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "o_proj"], 3),
}
PROMPTS = ["Hello there, how are you?", "def add(a, b):", "Show me a form", "Paris is"]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_model, root / name.replace("@", "-"), *spec)
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[LocalEngine]:
    engine = LocalEngine(tiny_model)
    yield engine
    engine.close()


def peft_greedy(
    base_dir: Path,
    adapter: Path | None,
    prompt: list[int],
    n: int,
    dtype: torch.dtype = torch.float32,
) -> list[int]:
    model: Any = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    if adapter is not None:
        # Adapter weights in the model's dtype too (PEFT would keep them float32).
        model = PeftModel.from_pretrained(model, adapter).to(dtype)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


async def collect(engine: LocalEngine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.numeric
def test_mixed_batch_equals_peft_per_adapter(
    engine: LocalEngine, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    plan = [(adapter, prompt) for adapter in [*adapters, None] for prompt in PROMPTS[:2]]
    requests = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt=tuple(engine.encode(prompt)),
            adapter=adapter,
            params=SamplingParams(max_tokens=16),
        )
        for i, (adapter, prompt) in enumerate(plan)
    ]

    async def run_all() -> list[list[GenerationChunk]]:
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    results = asyncio.run(run_all())
    assert engine.stats["max_batch"] >= 4, "the requests were not batched together"
    outputs = {r.request_id: tokens(c) for r, c in zip(requests, results, strict=True)}
    for request, (adapter, _) in zip(requests, plan, strict=True):
        prompt_ids = list(request.prompt) if isinstance(request.prompt, tuple) else []
        expected = peft_greedy(tiny_model, adapters.get(adapter or ""), prompt_ids, 16)
        assert outputs[request.request_id] == expected, (adapter, request.request_id)
    # The adapters really change the output, so the equality above is not trivial.
    base_out = outputs["r6"]
    assert all(outputs[f"r{i}"] != base_out for i in (0, 2, 4))


def test_adapter_rank_and_files_are_checked_before_loading(
    engine: LocalEngine, tmp_path: Path, adapters: dict[str, Path]
) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 128, "lora_alpha": 16, "target_modules": ["q_proj"]})
    )
    with pytest.raises(AdapterRankTooLarge) as caught:
        engine.load_adapter("coding@9", str(big))  # no weights file: the rank check came first
    assert caught.value.code == "adapter_rank_too_large"
    with pytest.raises(AdapterInvalid):
        engine.load_adapter("coding@10", str(tmp_path / "missing"))
    with pytest.raises(AdapterInvalid):
        engine.load_adapter("not-versioned", str(adapters["coding@1"]))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(
        (adapters["coding@1"] / "adapter_config.json").read_text()
    )
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterInvalid):
        engine.load_adapter("coding@11", str(broken))
    assert engine.loaded_adapters() == []


def test_lru_eviction_under_capacity(tiny_model: Path, adapters: dict[str, Path]) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_adapters=2))
    try:
        engine.load_adapter("coding@1", str(adapters["coding@1"]))
        engine.load_adapter("agent@1", str(adapters["agent@1"]))

        async def use(name: str) -> None:
            await collect(
                engine,
                GenerationRequest(
                    request_id="u", prompt="hi", adapter=name, params=SamplingParams(max_tokens=2)
                ),
            )

        asyncio.run(use("coding@1"))  # agent@1 is now the least recently used
        engine.load_adapter("genui@1", str(adapters["genui@1"]))
        assert sorted(engine.loaded_adapters()) == ["coding@1", "genui@1"]
    finally:
        engine.close()


def test_adapter_capacity_refuses_when_all_are_busy(
    tiny_model: Path, adapters: dict[str, Path]
) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_adapters=1))
    try:
        engine.load_adapter("coding@1", str(adapters["coding@1"]))

        async def scenario() -> None:
            stream = engine.generate(
                GenerationRequest(
                    request_id="busy",
                    prompt="hi",
                    adapter="coding@1",
                    params=SamplingParams(max_tokens=500),
                )
            )
            await anext(stream)
            with pytest.raises(AdapterCapacityExceeded):
                engine.load_adapter("agent@1", str(adapters["agent@1"]))
            await stream.aclose()

        asyncio.run(scenario())
    finally:
        engine.close()


def test_unload_lets_requests_in_flight_finish(
    engine: LocalEngine, adapters: dict[str, Path]
) -> None:
    engine.load_adapter("coding@1", str(adapters["coding@1"]))

    async def scenario() -> list[GenerationChunk]:
        stream = engine.generate(
            GenerationRequest(
                request_id="inflight",
                prompt="hello",
                adapter="coding@1",
                params=SamplingParams(max_tokens=60, ignore_eos=True),
            )
        )
        chunks = [await anext(stream)]
        engine.unload_adapter("coding@1")
        assert "coding@1" not in engine.loaded_adapters()  # retired: no new requests
        with pytest.raises(AdapterNotFound):
            await collect(
                engine, GenerationRequest(request_id="late", prompt="x", adapter="coding@1")
            )
        chunks += [c async for c in stream]
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[-1].finish_reason == "length"
    assert len(tokens(chunks)) == 60, "the in-flight request was cut short"
    with pytest.raises(AdapterNotFound):
        engine.unload_adapter("coding@1")


@pytest.mark.numeric
def test_reloading_a_name_serves_the_new_weights(
    engine: LocalEngine, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    prompt = tuple(engine.encode("Hello there"))

    def run(adapter: str | None) -> list[int]:
        request = GenerationRequest(
            request_id="r", prompt=prompt, adapter=adapter, params=SamplingParams(max_tokens=8)
        )
        return tokens(asyncio.run(collect(engine, request)))

    engine.load_adapter("coding@5", str(adapters["coding@1"]))
    first = run("coding@5")
    engine.unload_adapter("coding@5")
    engine.load_adapter("coding@5", str(adapters["genui@1"]))
    assert run("coding@5") == peft_greedy(tiny_model, adapters["genui@1"], list(prompt), 8)
    assert run("coding@5") != first


def test_sampling_controls(engine: LocalEngine) -> None:
    def run(**params: object) -> list[GenerationChunk]:
        request = GenerationRequest(
            request_id="s", prompt="Once upon a time", params=SamplingParams.model_validate(params)
        )
        return asyncio.run(collect(engine, request))

    capped = run(max_tokens=5)
    assert len(tokens(capped)) == 5 and capped[-1].finish_reason == "length"
    assert capped[-1].completion_tokens == 5 and capped[-1].prompt_tokens > 0
    seeded = [tokens(run(temperature=1.0, top_p=0.9, seed=7, max_tokens=12)) for _ in range(2)]
    assert seeded[0] == seeded[1]
    other = tokens(run(temperature=1.0, top_p=0.9, seed=8, max_tokens=12))
    assert other != seeded[0]
    greedy_text = "".join(c.text for c in run(max_tokens=20, ignore_eos=True))
    visible = [i for i, ch in enumerate(greedy_text) if i > 0 and not ch.isspace()]
    assert visible, "the tiny model produced no text"
    at = visible[len(visible) // 2]
    stop = greedy_text[at : at + 2]
    stopped = run(max_tokens=20, ignore_eos=True, stop=[stop])
    text = "".join(c.text for c in stopped)
    assert stopped[-1].finish_reason == "stop" and stop not in text
    assert text == greedy_text[: greedy_text.index(stop)]


def test_cancel_stops_work(engine: LocalEngine) -> None:
    async def scenario() -> None:
        stream = engine.generate(
            GenerationRequest(
                request_id="c", prompt="tell me a story", params=SamplingParams(max_tokens=2000)
            )
        )
        await anext(stream)
        await stream.aclose()
        for _ in range(1000):
            if engine.stats["cancelled"] == 1 and engine.stats["active"] == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the cancelled request kept running")

    asyncio.run(scenario())
    assert engine.stats["tokens"] < 2000


def test_bounded_queue_answers_overloaded(tiny_model: Path) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_batch=1, max_queue=1))
    try:

        async def scenario() -> None:
            long = SamplingParams(max_tokens=2000)
            running = engine.generate(GenerationRequest(request_id="a", prompt="a", params=long))
            await anext(running)  # active, so the next one waits in the queue
            waiting = engine.generate(GenerationRequest(request_id="b", prompt="b", params=long))
            waiter = asyncio.ensure_future(anext(waiting))
            await asyncio.sleep(0.05)
            with pytest.raises(EngineOverloaded) as caught:
                await collect(engine, GenerationRequest(request_id="c", prompt="c"))
            assert caught.value.retryable and caught.value.code == "overloaded"
            await running.aclose()
            await waiter
            await waiting.aclose()

        asyncio.run(scenario())
    finally:
        engine.close()


def test_a_failing_request_gets_a_typed_error_and_the_engine_keeps_serving(
    engine: LocalEngine, tiny_model: Path, tmp_path: Path, adapters: dict[str, Path]
) -> None:
    broken = make_adapter(tiny_model, tmp_path / "nan", 4, ["down_proj"], 9)
    weights = load_file(str(broken / "adapter_model.safetensors"))
    save_file(
        {k: torch.full_like(v, float("nan")) for k, v in weights.items()},
        str(broken / "adapter_model.safetensors"),
    )
    engine.load_adapter("coding@7", str(broken))
    engine.load_adapter("coding@1", str(adapters["coding@1"]))
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=8)

    async def scenario() -> None:
        healthy = asyncio.ensure_future(
            collect(
                engine,
                GenerationRequest(
                    request_id="ok", prompt="fine", adapter="coding@1", params=sampled
                ),
            )
        )
        with pytest.raises(EngineError) as caught:
            await collect(
                engine,
                GenerationRequest(
                    request_id="nan", prompt="boom", adapter="coding@7", params=sampled
                ),
            )
        assert caught.value.code == "engine_error"
        assert (await healthy)[-1].finish_reason == "length"

    asyncio.run(scenario())
    after = asyncio.run(collect(engine, GenerationRequest(request_id="after", prompt="still")))
    assert after[-1].finish_reason in {"length", "stop"}


def test_close_answers_waiting_requests_and_refuses_new_ones(tiny_model: Path) -> None:
    engine = LocalEngine(tiny_model, limits=EngineLimits(max_batch=1))

    async def scenario() -> None:
        long = SamplingParams(max_tokens=5000, ignore_eos=True)
        running = engine.generate(GenerationRequest(request_id="a", prompt="a", params=long))
        await anext(running)
        waiting = asyncio.ensure_future(
            collect(engine, GenerationRequest(request_id="b", prompt="b", params=long))
        )
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
        with pytest.raises(EngineUnavailable):
            await waiting
        with pytest.raises(EngineUnavailable):
            async for _ in running:
                pass
        with pytest.raises(EngineUnavailable):
            await collect(engine, GenerationRequest(request_id="c", prompt="c"))

    asyncio.run(scenario())


def test_bad_requests_are_refused(engine: LocalEngine) -> None:
    with pytest.raises(ValueError):
        GenerationRequest(request_id="x", prompt="hi", adapter="../../etc")
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        asyncio.run(collect(engine, GenerationRequest(request_id="x", prompt=(10**9,))))
    with pytest.raises(AdapterNotFound):
        asyncio.run(
            collect(engine, GenerationRequest(request_id="x", prompt="hi", adapter="coding@404"))
        )
