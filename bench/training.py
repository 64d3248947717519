"""The training recipes at the demo's data sizes on SmolLM2-135M, time and peak memory, against
the code before issue 33's training work in the same run.

- CPU recipe (`lora-cpu.yaml`: 30 steps, batch 4, SFT): 32 GenUI records (the bank's prompts in
  the contexts `harness@0` builds, their reference answers as targets).
- Self-mode recipe (`lora-rloo.yaml`: SFT plus RLOO with a KL penalty): the self demo's agent
  run as a new user met it, 15 verified answers and 32 rollout groups of K = 4, three of them
  with answers that scored apart (12 policy-gradient samples).

Each run is a fresh Python process from a version-0 parent, so its peak resident memory
(`ru_maxrss`) is its own. The baseline is the same run on the code at BASELINE_REF (a git
worktree of it). Targets (issue 33): a run in <= 90 s; the self-mode run's peak RSS <= 3 GB; the
losses within 1 % of the baseline's (the same maths; the difference is float rounding). Where the
CPU has native bf16, each recipe runs a third time at ``precision: bfloat16`` (bf16 rows: its
time, memory and losses against the float32 run's).

Usage: python -m bench.training [--model PATH] [--baseline-ref REF]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import Row, report, row
from core.harness.artifact import root_version
from core.harness.hcp import build_context
from core.settings import default_home
from infra.hardware import has_native_bf16
from infra.models import pull_model
from learners.recipes.config import load_config
from learners.tasks import load_bank

BASE_MODEL = "smollm2-135m-instruct"
BASELINE_REF = "96d01b0"
"""main before the training memory work: every loss part's graph alive until one backward,
logits for every position."""
ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, tempfile, time, zlib
from pathlib import Path
from infra.identity_adapter import write_identity_adapter
from learners.recipes.config import Examples, TrainingConfig
from learners.recipes.lora import train_successor_adapter

job = json.load(sys.stdin)
with tempfile.TemporaryDirectory() as scratch:
    parent, out = Path(scratch, "parent"), Path(scratch, "out")
    write_identity_adapter(Path(job["model"]), parent, base_model=job["base"], rank=16,
                           seed=zlib.crc32(job["specialist"].encode()))
    result = train_successor_adapter(
        Path(job["model"]), parent, out,
        Examples.model_validate({"sft": job["sft"], "groups": job["groups"]}),
        TrainingConfig.model_validate(job["config"]),
    )
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": result.seconds, "losses": result.losses, "rss_mb": rss,
                  "samples": result.samples}))
"""


def _context(specialist: str, prompt: str) -> list[dict[str, Any]]:
    return build_context(root_version(), specialist, [], prompt).messages()


def _config(path: Path) -> dict[str, Any]:
    """A recipe's training settings as both codes read them, less those the baseline's lacks:
    ``sources`` picks a run's records from the log (the bench hands each run its records);
    ``device`` and ``precision`` keep their defaults, the CPU and float32."""
    return load_config(path).model_dump(mode="json", exclude={"sources", "device", "precision"})


def jobs() -> dict[str, dict[str, Any]]:
    """Each recipe's run: its config, SFT examples and rollout groups, as JSON."""
    bank = load_bank()
    genui = [t for t in bank if t.specialist == "genui"][:32]
    agent = [t for t in bank if t.specialist == "agent"]
    recipes = ROOT / "learners" / "recipes"
    groups = []
    for index, task in enumerate(agent[15:47]):
        wrong = agent[(index + 1) % len(agent)].reference
        mixed = index % 11 == 0  # three of the 32 groups scored apart
        groups.append(
            {
                "messages": _context("agent", task.prompt),
                "answers": [task.reference if mixed else wrong, wrong, wrong, wrong],
                "rewards": [1.0 if mixed else 0.0, 0.0, 0.0, 0.0],
            }
        )
    return {
        "CPU recipe (SFT)": {
            "specialist": "genui",
            "config": _config(recipes / "lora-cpu.yaml"),
            "sft": [
                {"messages": _context("genui", t.prompt), "target": t.reference} for t in genui
            ],
            "groups": [],
        },
        "self-mode recipe (SFT + RLOO)": {
            "specialist": "agent",
            "config": _config(recipes / "lora-rloo.yaml"),
            "sft": [
                {"messages": _context("agent", t.prompt), "target": t.reference} for t in agent[:15]
            ],
            "groups": groups,
        },
    }


def run(tree: Path, job: dict[str, Any]) -> dict[str, Any]:
    """One training run in a fresh process on the code in ``tree``."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(job),
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"training in {tree} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    args = parser.parse_args()
    model_dir = args.model or pull_model(default_home(), BASE_MODEL, print)[0]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="macaron-bench-baseline-") as scratch:
        baseline_tree = Path(scratch, "tree")
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline_tree), args.baseline_ref],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            for name, job in jobs().items():
                job |= {"model": str(model_dir), "base": BASE_MODEL}
                before, now = run(baseline_tree, job), run(ROOT, job)
                print(f"{name}: {now['samples']} policy-gradient samples")
                rows += _rows(name, before, now)
                if has_native_bf16():
                    bf16_config = job["config"] | {"precision": "bfloat16"}
                    bf16 = run(ROOT, job | {"config": bf16_config})
                    rows += _bf16_rows(name, now, bf16)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(baseline_tree)],
                cwd=ROOT,
                check=False,
            )
    report("training", rows)


def _drift(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step, in per cent."""
    return 100 * max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(losses, reference, strict=True))


def _rows(name: str, before: dict[str, Any], now: dict[str, Any]) -> list[Row]:
    memory = "<= 3072 MB" if "RLOO" in name else "report"
    return [
        row(f"{name}: run", now["seconds"], "s", before["seconds"], "<= 90 s"),
        row(f"{name}: peak RSS", now["rss_mb"], "MB", before["rss_mb"], memory),
        row(f"{name}: last loss", now["losses"][-1], "nats", before["losses"][-1], "report"),
        row(
            f"{name}: largest relative loss difference",
            _drift(now["losses"], before["losses"]),
            "%",
            1.0,
            "<= 1 %",
        ),
    ]


def _bf16_rows(name: str, float32: dict[str, Any], bf16: dict[str, Any]) -> list[Row]:
    """The bf16 run against the float32 run of the same code (its baseline here)."""
    memory = "<= 3072 MB" if "RLOO" in name else "report"
    first = 100 * abs(bf16["losses"][0] - float32["losses"][0]) / abs(float32["losses"][0])
    return [
        row(f"{name}, bf16: run", bf16["seconds"], "s", float32["seconds"], "<= 90 s"),
        row(f"{name}, bf16: peak RSS", bf16["rss_mb"], "MB", float32["rss_mb"], memory),
        row(f"{name}, bf16: first-step loss difference", first, "%", 1.0, "<= 1 %"),
        row(
            f"{name}, bf16: largest relative loss difference",
            _drift(bf16["losses"], float32["losses"]),
            "%",
            1.0,
            "<= 1 %",
        ),
    ]


if __name__ == "__main__":
    main()
