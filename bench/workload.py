"""The engine benchmarks' shared workload: the prompts, random rank-16 adapters on every linear
layer, and the tokens/s of concurrent requests on given adapters. Torch and the engine port
only, so the GPU script can run it on a machine that has no database driver."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.engine import Engine, GenerationRequest, SamplingParams
from engines.local.lora_layers import TARGETS

RANK = 16
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for better sleep.",
    "What is the capital of France?",
    "Describe a sunset in one paragraph.",
    "How do I reverse a list in Python?",
    "Suggest a name for a bakery.",
    "Summarise the plot of Hamlet.",
]


def make_adapters(model_dir: Path, out: Path, count: int) -> dict[str, Path]:
    """Random rank-16 LoRA adapters in PEFT format on every linear layer of the model."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    adapters = {}
    for n in range(count):
        generator = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for proj in TARGETS:
                fan_in, fan_out = shapes[proj]
                part = "self_attn" if proj in {"q_proj", "k_proj", "v_proj", "o_proj"} else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(RANK, fan_in, generator=generator) * 0.01
                )
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(fan_out, RANK, generator=generator) * 0.01
                )
        folder = out / f"adapter-{n}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": RANK,
                    "lora_alpha": 2 * RANK,
                    "target_modules": list(TARGETS),
                    "lora_dropout": 0.0,
                    "bias": "none",
                    "task_type": "CAUSAL_LM",
                    "base_model_name_or_path": str(model_dir),
                }
            )
        )
        adapters[f"bench{n}@1"] = folder
    return adapters


def throughput(engine: Engine, runs: dict[str, list[str | None]], tokens: int) -> dict[str, float]:
    """Tokens/s of each run: len(assign) concurrent requests, request i on adapter assign[i];
    the best of two after a warm-up."""
    n = max(len(assign) for assign in runs.values())
    prompts = [
        engine.chat_prompt([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        for i in range(n)
    ]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def batch(assign: list[str | None]) -> float:
        async def one(i: int) -> int:
            request = GenerationRequest(
                request_id=f"b{i}", prompt=prompts[i], adapter=assign[i], params=params
            )
            return sum([len(c.token_ids) async for c in engine.generate(request)])

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(i) for i in range(len(assign)))))
        return produced / (time.perf_counter() - start)

    asyncio.run(batch(next(iter(runs.values()))))  # warm-up
    return {
        label: max(asyncio.run(batch(assign)) for _ in range(2)) for label, assign in runs.items()
    }


def workload(names: list[str], n: int, base: bool) -> dict[str, list[str | None]]:
    runs: dict[str, list[str | None]] = {
        "single": [names[0]] * n,
        "mixed": [names[i % len(names)] for i in range(n)],
    }
    if base:
        runs["base"] = [None] * n
    return runs
