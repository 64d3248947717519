"""The GPU check, in one script (``bench/gpu.sh``): the LoRA kernels against the reference
(Triton on CUDA), the local engine on CUDA in bfloat16 and in float32 (8 requests x 64 tokens on
8 adapters and on one, against PEFT generating the same requests one by one on the same GPU),
and one training run of the recipe (SFT, rank 16) on CUDA.

The model is random weights of SmolLM2-135M's shape with SmolLM2's tokenizer: a GPU machine
here can fetch nothing, SmolLM2's 540 MB of weights cannot travel to it, and throughput does
not depend on the weights' values. ``--dry-run`` runs every part on the CPU with a tiny shape
and 8-token answers, in seconds, and writes its rows to ``--results`` (CI runs it, so the
script cannot rot; a dry run's figures mean nothing). vLLM is not timed here: the GPU machine
has no vLLM, and its CUDA wheel is too large to carry there.

Usage: python -m bench.gpu --tokenizer DIR [--dry-run] [--results DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.report import RESULTS, Row, report, row
from bench.workload import PROMPTS, make_adapters, throughput, workload
from core.events import ChatMessage
from kernels.lora import (
    LoRAStack,
    expand_reference,
    expand_segments,
    lora_expand,
    lora_shrink,
    shrink_reference,
    shrink_segments,
)

SHAPES: dict[str, dict[str, int]] = {
    "smollm2": {  # SmolLM2-135M
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
KERNEL_SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "down_proj": (1536, 576)}


def random_model(out: Path, tokenizer_dir: Path, shape: dict[str, int]) -> Path:
    """A Llama of ``shape`` with random weights and the tokenizer of ``tokenizer_dir``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def synchronized(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else lambda: None


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    sync = synchronized(device)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def kernel_rows(device: str, dry: bool) -> list[Row]:
    """``lora_shrink``/``lora_expand`` (Triton on CUDA, segments on the CPU) against the
    reference, then timed against the torch segments path on the same device."""
    dtypes = [torch.float32] if dry else [torch.float32, torch.bfloat16]
    gen = torch.Generator().manual_seed(0)
    return [
        kernel_row(name, shape, dtype, device, dry, gen)
        for dtype in dtypes
        for name, shape in KERNEL_SHAPES.items()
    ]


def kernel_row(
    name: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: str,
    dry: bool,
    gen: torch.Generator,
) -> Row:
    tokens, adapters, rank = (16, 3, 4) if dry else (256, 8, 16)
    fan_in, fan_out = (shape[0] // 16, shape[1] // 16) if dry else shape
    pairs = [
        (torch.randn(rank, fan_in, generator=gen), torch.randn(fan_out, rank, generator=gen), 0.5)
        for _ in range(adapters)
    ]
    cpu = LoRAStack.of(pairs)
    idx = torch.randint(-1, adapters, (tokens,), generator=gen)
    x, y = torch.randn(tokens, fan_in, generator=gen), torch.randn(tokens, fan_out, generator=gen)
    want = expand_reference(y, shrink_reference(x, cpu.a, idx), cpu.b, cpu.scale, idx)
    stack = LoRAStack(*(t.to(device, dtype) for t in (cpu.a, cpu.b, cpu.scale)))
    xd, yd, ids = x.to(device, dtype), y.to(device, dtype), idx.to(device)

    def fast() -> torch.Tensor:
        return lora_expand(yd, lora_shrink(xd, stack, ids), stack, ids)

    def plain() -> torch.Tensor:
        h = shrink_segments(xd, stack.a, ids)
        return expand_segments(yd, h, stack.b, stack.scale, ids)

    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = float((fast().float().cpu() - want).abs().max() / want.abs().max())
    if error > tolerance:
        raise SystemExit(f"{name} {dtype}: relative error {error:.2e} > {tolerance}")
    repeats = 3 if dry else 50
    kernel = "triton" if device == "cuda" else "segments"
    return row(
        f"lora kernels ({kernel}), {name} {str(dtype).removeprefix('torch.')}, match the "
        "reference (vs torch segments)",
        tokens / timed(fast, device, repeats),
        "tokens/s",
        tokens / timed(plain, device, repeats),
        "report",
    )


def peft_sequential(
    model_dir: Path, adapters: dict[str, Path], n: int, tokens: int, device: str, dtype: Any
) -> float:
    """Tokens/s of PEFT generating the ``n`` requests one by one, switching adapter each time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    base: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    names = list(adapters)
    model: Any = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.to(device=device, dtype=dtype).eval()
    produced, sync = 0, synchronized(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(n):
            model.set_adapter(names[i % len(names)])
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            ).to(device)
            out = model.generate(
                **prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
            )
            produced += out.shape[1] - prompt["input_ids"].shape[1]
    sync()
    return produced / (time.perf_counter() - start)


def engine_rows(model_dir: Path, work: Path, device: str, dry: bool) -> list[Row]:
    """The local engine on ``device`` in each dtype, 8 concurrent requests, against PEFT."""
    from engines.local.engine import LocalEngine

    n, tokens = 8, 8 if dry else 64
    adapters = make_adapters(model_dir, work / "adapters", 8)
    dtypes = [torch.float32] if dry else [torch.bfloat16, torch.float32]
    rows = []
    for dtype in dtypes:
        label = str(dtype).removeprefix("torch.")
        engine = LocalEngine(model_dir, dtype=dtype, device=device)
        try:
            for name, path in adapters.items():
                engine.load_adapter(name, str(path))
            results = throughput(engine, workload(list(adapters), n, base=False), tokens)
        finally:
            engine.close()
        peft = peft_sequential(model_dir, adapters, n, tokens, device, dtype)
        for run, what in (("mixed", "8 adapters"), ("single", "one adapter")):
            rows.append(
                row(
                    f"engine on {device}, {label}, {n} requests on {what} (vs PEFT sequential)",
                    results[run],
                    "tokens/s",
                    peft,
                    "report",
                )
            )
    return rows


def training_rows(model_dir: Path, work: Path, device: str, dry: bool) -> list[Row]:
    """One run of the recipe (SFT on 32 examples) on ``device``, whole (loading, tokenising,
    saving), against its mean step after the first."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engines.local.lora_layers import TARGETS
    from learners.recipes.config import CPU_CONFIG, Examples, SFTExample, load_config
    from learners.recipes.lora import train_successor_adapter

    parent = work / "parent"
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS), lora_dropout=0.0)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora).save_pretrained(parent)
    steps = 2 if dry else 30
    config = load_config(CPU_CONFIG).model_copy(update={"device": device, "steps": steps})
    examples = [
        SFTExample(
            messages=[ChatMessage(role="user", content=PROMPTS[i % len(PROMPTS)] + f" ({i})")],
            target=f"Answer number {i}: " + "the sea is wide and deep. " * 8,
        )
        for i in range(32)
    ]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seen: list[float] = []
    result = train_successor_adapter(
        model_dir,
        parent,
        work / "successor",
        Examples(sft=examples),
        config,
        progress=lambda *_: seen.append(time.perf_counter()),
    )
    per_step = (seen[-1] - seen[0]) / max(len(seen) - 1, 1)
    rows = [
        row(
            f"training run on {device}, {steps} steps (vs its mean step)",
            result.seconds,
            "s",
            per_step,
            "report",
        )
    ]
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row("training run, peak GPU memory", peak, "GiB", peak, "report"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", type=Path, required=True, help="a folder holding SmolLM2's tokenizer"
    )
    parser.add_argument("--dry-run", action="store_true", help="the CPU, a tiny shape, seconds")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where gpu.json goes")
    args = parser.parse_args()
    dry: bool = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run this on a GPU machine, or pass --dry-run")
    device = "cpu" if dry else "cuda"
    import peft
    import transformers

    versions = f"transformers {transformers.__version__}, peft {peft.__version__}"
    print(f"torch {torch.__version__}, {versions}")
    if not dry:
        print(f"device: {torch.cuda.get_device_name()}")
    bench = "gpu-dry-run" if dry else "gpu"
    with tempfile.TemporaryDirectory(prefix="macaron-gpu-") as tmp:
        work = Path(tmp)
        model = random_model(work / "model", args.tokenizer, SHAPES["tiny" if dry else "smollm2"])
        parts: list[tuple[str, Callable[[], list[Row]]]] = [
            ("kernels", lambda: kernel_rows(device, dry)),
            ("engine", lambda: engine_rows(model, work, device, dry)),
            ("training", lambda: training_rows(model, work, device, dry)),
        ]
        rows: list[Row] = []
        for name, part in parts:  # the rows so far are written after each part
            start = time.perf_counter()
            rows += part()
            print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
            report(bench, rows, args.results)


if __name__ == "__main__":
    main()
