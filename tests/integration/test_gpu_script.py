"""``bench/gpu.sh --dry-run`` runs every part of the GPU check on the CPU (a tiny shape, in
seconds), so the script a GPU machine runs cannot rot between the sessions that have one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_script_runs_dry_on_the_cpu(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "GPU_TOKENIZER": str(tiny_model), "GPU_RESULTS": str(tmp_path)}
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for part in ("kernels:", "engine:", "training:"):
        assert part in done.stdout, done.stdout[-3000:]
    rows = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    names = [r["name"] for r in rows]
    assert sum(n.startswith("lora kernels (segments)") for n in names) == 3, names
    assert any(n.startswith("engine on cpu, float32, 8 requests on 8 adapters") for n in names)
    assert any(n.startswith("training run on cpu, 2 steps") for n in names)
    assert all(r["value"] > 0 and r["baseline"] > 0 for r in rows), rows


def test_the_gpu_script_refuses_an_unknown_mode() -> None:
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "usage: bash bench/gpu.sh" in done.stderr
