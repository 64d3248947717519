"""The content-addressed artifact store for adapters: ``$MACARON_HOME/adapters/<sha256>/``.

An adapter's address is the sha256 over its files (names and contents), so a folder whose bytes
changed no longer matches its address: ``verified_path`` refuses it before an engine loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.errors import AdapterInvalid, AdapterNotFound

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def folder_digest(folder: Path) -> str:
    """sha256 over the adapter files' names and contents, in a fixed order."""
    outer = hashlib.sha256()
    for name in ADAPTER_FILES:
        inner = hashlib.sha256()
        try:
            with (folder / name).open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    inner.update(block)
        except OSError as exc:
            raise AdapterInvalid(f"{folder}: cannot read {name} ({exc})") from exc
        outer.update(f"{name}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, folder: Path) -> tuple[str, Path]:
        """Copy an adapter folder into the store; returns its digest and stored path.
        Storing the same content twice is a no-op."""
        digest = folder_digest(folder)
        target = self.root / digest
        if target.exists():
            return digest, target
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        for name in ADAPTER_FILES:
            shutil.copyfile(folder / name, staging / name)
        try:
            os.rename(staging, target)  # atomic: a reader sees all of it or nothing
        except OSError:
            shutil.rmtree(staging)  # another writer stored the same content first
        return digest, target

    def verified_path(self, sha256: str, path: str) -> Path:
        """The stored folder for ``sha256``, after checking it lies in the store and that its
        content still hashes to its address."""
        folder = Path(path).resolve()
        if folder.parent != self.root.resolve() or folder.name != sha256:
            raise AdapterInvalid(f"adapter path {path} is not {sha256} in the artifact store")
        if not folder.is_dir():
            raise AdapterNotFound(f"adapter {sha256} is missing from the artifact store")
        actual = folder_digest(folder)
        if actual != sha256:
            raise AdapterInvalid(f"adapter {sha256} is corrupted: its content hashes to {actual}")
        return folder


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target of a Llama-family model, from its config."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }


def write_identity_adapter(
    model_dir: Path, out: Path, *, base_model: str, rank: int, seed: int
) -> None:
    """A version-0 adapter in PEFT format that computes exactly the base model (``B = 0``;
    ``A`` seeded as PEFT initialises it), so that training its successor can start from it."""
    config = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in _TARGETS:
            fan_in, fan_out = shapes[proj]
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            bound = 1 / fan_in**0.5
            a = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(fan_out, rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(_TARGETS),
        "base_model_name_or_path": base_model,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
