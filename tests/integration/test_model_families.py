"""The local engine serves the Llama, Qwen2 (biased projections of queries, keys and values) and
Mistral (a sliding attention window) families: tiny random models of each, made locally, with
adapters, answer token for token as transformers and PEFT do (mixed adapters in one batch,
prompts computed in chunks, a prompt continued from the prefix cache past the window). A model
folder the engine cannot serve is refused at load with a typed error naming what is wrong."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from core.engine import GenerationChunk, GenerationRequest, SamplingParams
from core.errors import DtypeUnsupported, ModelInvalid, ModelUnavailable, ModelUnsupported
from engines.local.engine import LocalEngine
from engines.local.limits import EngineLimits
from infra.hardware import native_dtype
from infra.models import TINY_FAMILIES, TINY_WINDOW, make_tiny_model
from tests.factories import make_adapter, run_macaron
from tests.integration.test_local_engine import peft_greedy

ADAPTERS = {  # name: (rank, target modules, seed)
    "coding@1": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
    "agent@1": (4, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 2),
}
LONG = "Write a short story about a robot who learns to paint the sea at night, in three parts."
PROMPTS = ["Hello there, how are you?", LONG]
NEW_TOKENS = 24
BF16_PROMPTS = [*PROMPTS, "def add(a, b):", "Show me a form with a name field", "Paris is"]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_model(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return make_tiny_model(folder / "model", tokenizer, seed=0, family=request.param)


def answers(engine: LocalEngine, plan: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Greedy answers of every (adapter, prompt) of ``plan``, all queued at once."""

    async def one(adapter: str | None, prompt: list[int], n: int) -> list[int]:
        request = GenerationRequest(
            request_id=f"r{n}",
            prompt=tuple(prompt),
            adapter=adapter,
            params=SamplingParams(max_tokens=NEW_TOKENS),
        )
        chunks: list[GenerationChunk] = [c async for c in engine.generate(request)]
        return [t for c in chunks for t in c.token_ids]

    async def run_all() -> list[list[int]]:
        return await asyncio.gather(*(one(a, p, n) for n, (a, p) in enumerate(plan)))

    return asyncio.run(run_all())


@pytest.mark.numeric
def test_every_family_answers_as_peft_does(
    family_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_adapter(family_model, root / name.replace("@", "-"), *spec)
        for name, spec in ADAPTERS.items()
    }
    engine = LocalEngine(family_model, limits=EngineLimits(prefill_budget=8))
    try:
        for name, path in adapters.items():
            engine.load_adapter(name, str(path))
        prompts = [engine.encode(p) for p in PROMPTS]
        assert len(prompts[1]) > TINY_WINDOW, "the long prompt must reach past the window"
        plan = [(adapter, p) for adapter in [*adapters, None] for p in prompts]
        first = answers(engine, plan)
        # The long prompt continued, on each adapter: taken from the prefix cache, then
        # computed on from past the window.
        longer = prompts[1] + engine.encode(" Then the sea answers.")[1:]
        hits = engine.prefixes.stats["hits"]
        second = answers(engine, [(adapter, longer) for adapter in [*adapters, None]])
        assert engine.prefixes.stats["hits"] >= hits + 3
        assert engine.stats["prefill_passes"] > len(plan), "no prompt was computed in chunks"
    finally:
        engine.close()
    expected_first = [
        peft_greedy(family_model, adapters.get(a or ""), p, NEW_TOKENS) for a, p in plan
    ]
    assert first == expected_first
    expected_second = [
        peft_greedy(family_model, adapters.get(a or ""), longer, NEW_TOKENS)
        for a in [*adapters, None]
    ]
    assert second == expected_second
    # The adapters change the answers, so the equality above is not trivial.
    assert first[0] != first[4] and first[2] != first[4]


@pytest.mark.numeric
def test_qwen2_biases_and_mistral_windows_change_the_answer(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The families' differences from Llama change what transformers answers (a Qwen2 model
    with its biases zeroed, a Mistral model with its window removed), so an engine that
    dropped either could not pass the equality test above."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tokenizer(LONG)["input_ids"]
    for family in ("qwen2", "mistral"):
        folder = make_tiny_model(tmp_path / family, tokenizer, seed=0, family=family)
        plain = tmp_path / f"{family}-plain"
        shutil.copytree(folder, plain)
        if family == "qwen2":
            weights = load_file(plain / "model.safetensors")
            for key in weights:
                if key.endswith("_proj.bias"):
                    weights[key] = torch.zeros_like(weights[key])
            save_file(weights, plain / "model.safetensors", metadata={"format": "pt"})
        else:
            config = json.loads((plain / "config.json").read_text())
            config["sliding_window"] = None
            (plain / "config.json").write_text(json.dumps(config))
        assert peft_greedy(folder, None, prompt, NEW_TOKENS) != peft_greedy(
            plain, None, prompt, NEW_TOKENS
        ), family


def broken_copy(tiny_model: Path, into: Path) -> Path:
    shutil.copytree(tiny_model, into)
    return into


def test_an_unsupported_architecture_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))
    ).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    with pytest.raises(ModelUnsupported, match="gpt2 model; the local engine serves the llama"):
        LocalEngine(gpt2)
    unknown = broken_copy(tiny_model, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "nonsense"}))
    with pytest.raises(ModelUnsupported, match="is a nonsense model"):
        LocalEngine(unknown)
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": None}))
    with pytest.raises(ModelInvalid, match="names no model_type"):
        LocalEngine(unknown)
    (unknown / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelInvalid, match="not a JSON object"):
        LocalEngine(unknown)


def test_missing_or_misshapen_tensors_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    missing = broken_copy(tiny_model, tmp_path / "missing")
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelInvalid, match=r"lack 1 tensors, first model.layers.1.mlp.up_proj"):
        LocalEngine(missing)

    misshapen = broken_copy(tiny_model, tmp_path / "misshapen")
    weights = load_file(misshapen / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, misshapen / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelInvalid, match=r"k_proj.weight: \(3, 64\) stored, \(32, 64\) expected"):
        LocalEngine(misshapen)


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    bare = broken_copy(tiny_model, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelInvalid, match="no chat template"):
        LocalEngine(bare)
    with pytest.raises(ModelUnavailable, match=r"no config\.json"):
        LocalEngine(tmp_path / "nowhere")


def test_serve_names_the_error_without_a_traceback(tiny_model: Path, tmp_path: Path) -> None:
    unknown = broken_copy(tiny_model, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    served = run_macaron(
        "serve",
        MACARON_HOME=str(tmp_path / "home"),
        MACARON_MODEL_DIR=str(unknown),
    )
    assert served.returncode != 0
    assert "model_unsupported" in served.stderr, served.stderr[-2000:]
    assert "Traceback" not in served.stderr


def first_divergence(a: list[int], b: list[int]) -> int:
    """The position of the first token where two answers differ (their length if none)."""
    return next(
        (n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.numeric
def test_bfloat16_follows_peft_in_bfloat16(
    family_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """In bfloat16 the engine's batched sums round otherwise than PEFT's, so greedy answers part
    once two tokens' logits come within bf16's precision (these random models have many near
    ties). The tolerance, per family over a fixed prompt set with and without an adapter: on
    average, the engine's answers stay with PEFT's bf16 answers for at least as many tokens as
    PEFT's bf16 answers stay with its own float32 ones (the engine's rounding differs from
    PEFT's by less than bf16 differs from float32), and as many of them or more agree whole.
    (The engine's decode attention masks each row's keys within the batch's longest, which
    rounds the last bf16 bit otherwise than PEFT's unmasked attention of one row.)"""
    adapter = make_adapter(
        family_model, tmp_path_factory.mktemp("bf16") / "a", 8, ["q_proj", "v_proj", "up_proj"], 4
    )
    engine = LocalEngine(family_model, dtype=torch.bfloat16)
    try:
        engine.load_adapter("coding@1", str(adapter))
        plan = [(a, engine.encode(p)) for a in ("coding@1", None) for p in BF16_PROMPTS]
        got = answers(engine, plan)
    finally:
        engine.close()

    def peft(dtype: torch.dtype) -> list[list[int]]:
        return [
            peft_greedy(family_model, adapter if a else None, p, NEW_TOKENS, dtype) for a, p in plan
        ]

    assert_follows_peft_in_bfloat16(got, peft(torch.bfloat16), peft(torch.float32))


def assert_follows_peft_in_bfloat16(
    got: list[list[int]], in_bf16: list[list[int]], in_float32: list[list[int]]
) -> None:
    """The bf16 yardstick: on average, ``got`` stays with PEFT's bf16 answers for at least as
    many tokens as those stay with PEFT's float32 answers, and as many of it agree whole."""
    served = [first_divergence(g, b) for g, b in zip(got, in_bf16, strict=True)]
    dtype = [first_divergence(b, f) for b, f in zip(in_bf16, in_float32, strict=True)]
    assert sum(served) >= sum(dtype), (served, dtype)
    whole = [sum(d == NEW_TOKENS for d in parts) for parts in (served, dtype)]
    assert whole[0] >= whole[1], (served, dtype)


def test_the_served_dtype_is_checked(tmp_path: Path) -> None:
    with_bf16 = tmp_path / "with"
    with_bf16.write_text("flags : fpu sse avx2 avx512f avx512_bf16\n")
    without = tmp_path / "without"
    without.write_text("flags : fpu sse avx2\n")
    assert native_dtype("float32", cpuinfo=without) is torch.float32
    assert native_dtype("bfloat16", cpuinfo=with_bf16) is torch.bfloat16
    with pytest.raises(DtypeUnsupported, match="no native bfloat16"):
        native_dtype("bfloat16", cpuinfo=without)
    with pytest.raises(DtypeUnsupported, match="no dtype 'float16'"):
        native_dtype("float16", cpuinfo=with_bf16)


def test_serve_refuses_an_unknown_dtype_by_name(tiny_model: Path, tmp_path: Path) -> None:
    served = run_macaron(
        "serve",
        MACARON_HOME=str(tmp_path / "home"),
        MACARON_MODEL_DIR=str(tiny_model),
        MACARON_DTYPE="float16",
    )
    assert served.returncode != 0
    assert "config_invalid" in served.stderr and "MACARON_DTYPE" in served.stderr, served.stderr
    assert "Traceback" not in served.stderr
