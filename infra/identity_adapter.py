"""Version-0 adapters: LoRA weights in PEFT format that compute exactly the base model, made
from the base model's config (kept apart from the artifact store, which needs no torch), stored
and registered as a specialist's first version."""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from core.registry import NewAdapterVersion
from core.release import AdapterRef
from infra.artifacts import ArtifactStore
from infra.postgres.db import DictConnection
from infra.postgres.registry import register_adapter

IDENTITY_RANK = 16

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def store_identity_adapter(
    store: ArtifactStore, model_dir: Path, base_model: str, specialist: str
) -> tuple[str, Path]:
    """``specialist``'s version-0 adapter in ``store``: its (sha256, path)."""
    with tempfile.TemporaryDirectory() as scratch:
        write_identity_adapter(
            model_dir,
            Path(scratch),
            base_model=base_model,
            rank=IDENTITY_RANK,
            seed=zlib.crc32(specialist.encode()),
        )
        return store.put(Path(scratch))


def register_identity_adapter(
    conn: DictConnection, specialist: str, sha: str, path: Path, base_model: str
) -> AdapterRef:
    """Register a stored version-0 adapter (``store_identity_adapter``) as ``specialist@0``."""
    return register_adapter(
        conn,
        NewAdapterVersion(
            specialist=specialist,
            version=0,
            parent_id=None,
            sha256=sha,
            path=str(path),
            rank=IDENTITY_RANK,
            base_model=base_model,
        ),
    )
