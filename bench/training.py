"""The CPU recipe's run at the demo's data size: 32 GenUI records (the bank's prompts in the
contexts `harness@0` builds, their reference answers as targets), SmolLM2-135M, a version-0
parent, `learners/recipes/lora-cpu.yaml` (30 steps, batch 4, SFT).

Baseline, in the same run: the same training with every row computed whole (the shared prompt
prefix turned off). Target: the run in <= 90 s, with the same losses (the two paths are the
same maths; the difference is float rounding).

Usage: python -m bench.training [--model PATH] [--records N]
"""

from __future__ import annotations

import argparse
import tempfile
import zlib
from pathlib import Path

import torch

from bench.report import report, row
from core.events import ChatMessage
from core.harness.artifact import root_version
from core.harness.hcp import build_context
from core.settings import default_home
from infra.identity_adapter import write_identity_adapter
from infra.models import pull_model
from learners.recipes import losses
from learners.recipes.config import CPU_CONFIG, SFTExample, TrainingResult, load_config
from learners.recipes.lora import train_successor_adapter
from learners.tasks import load_bank

BASE_MODEL = "smollm2-135m-instruct"


def records(count: int) -> list[SFTExample]:
    """The first ``count`` GenUI tasks of the bank as the demo's users teach them."""
    harness = root_version()
    tasks = [t for t in load_bank() if t.specialist == "genui"][:count]
    return [
        SFTExample(
            messages=[
                ChatMessage.model_validate(m)
                for m in build_context(harness, "genui", [], t.prompt).messages()
            ],
            target=t.reference,
        )
        for t in tasks
    ]


def train(model_dir: Path, sft: list[SFTExample], *, shared: bool) -> TrainingResult:
    """One run of the CPU recipe from a fresh version-0 parent; ``shared`` off computes every
    row whole."""
    minimum = losses.SHARED_PREFIX_MIN
    losses.SHARED_PREFIX_MIN = minimum if shared else 10**9
    try:
        with tempfile.TemporaryDirectory() as scratch:
            parent, out = Path(scratch, "parent"), Path(scratch, "out")
            write_identity_adapter(
                model_dir, parent, base_model=BASE_MODEL, rank=16, seed=zlib.crc32(b"genui")
            )
            return train_successor_adapter(
                model_dir,
                parent,
                out,
                sft=sft,
                preferences=[],
                older=[],
                config=load_config(CPU_CONFIG),
            )
    finally:
        losses.SHARED_PREFIX_MIN = minimum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--records", type=int, default=32)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    sft = records(args.records)
    print(f"{len(sft)} records, torch threads: {torch.get_num_threads()}")
    whole = train(model_dir, sft, shared=False)
    shared = train(model_dir, sft, shared=True)
    drift = max(abs(a - b) / abs(b) for a, b in zip(shared.losses, whole.losses, strict=True))
    report(
        "training",
        [
            row(
                "CPU recipe run, shared prompt prefix",
                shared.seconds,
                "s",
                whole.seconds,
                "<= 90 s",
            ),
            row(
                "CPU recipe run, rows whole (baseline)", whole.seconds, "s", whole.seconds, "report"
            ),
            row("first loss, shared / whole", shared.losses[0], "nats", whole.losses[0], "report"),
            row("last loss, shared / whole", shared.losses[-1], "nats", whole.losses[-1], "report"),
            row("largest relative loss difference", 100 * drift, "%", 100 * drift, "<= 0.1 %"),
        ],
    )


if __name__ == "__main__":
    main()
