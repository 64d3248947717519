"""Loading the local engine's base model from a checkpoint folder (``config.json``, safetensors
weights, a tokenizer with a chat template), checked before anything is served: an architecture
the engine's forward pass does not cover is ``model_unsupported``; missing tensors, a shape that
does not match the config, or a tokenizer without a chat template are ``model_invalid``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from core.errors import ModelInvalid, ModelUnavailable, ModelUnsupported

FAMILIES = ("llama", "qwen2", "mistral")  # the config's model_type


def check_base_model(model_dir: Path) -> Any:
    """``model_dir``'s tokenizer, once its config names a family the engine serves and the
    tokenizer has a chat template (seconds: no weight is read)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelUnavailable(f"{model_dir} holds no config.json: not a model folder")
    try:  # the family first, read plainly: transformers may not know it at all
        model_type = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelInvalid(f"{path} is not a JSON object ({exc})") from exc
    if not isinstance(model_type, str):
        raise ModelInvalid(f"{path} names no model_type")
    if model_type not in FAMILIES:
        raise ModelUnsupported(
            f"{model_dir} is a {model_type} model; the local engine serves the "
            f"{', '.join(FAMILIES)} families"
        )
    try:
        AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types on a bad config
        raise ModelInvalid(f"{path} is invalid ({_first_line(exc)})") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # the tokenizers library raises plain Exception on a bad file
        raise ModelInvalid(f"{model_dir}: no readable tokenizer ({_first_line(exc)})") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise ModelInvalid(
            f"{model_dir}: the tokenizer has no chat template, so a conversation cannot be "
            "turned into a prompt; use an instruct checkpoint or add chat_template to "
            "tokenizer_config.json"
        )
    return tokenizer


def load_base_model(model_dir: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The tokenizer and the frozen model of ``model_dir``, in ``dtype``, checked."""
    tokenizer = check_base_model(model_dir)
    try:  # mismatched shapes are loaded as new tensors and reported, so they can be named
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
        model, info = loaded
    except Exception as exc:  # safetensors, torch and transformers each raise their own
        raise ModelInvalid(f"{model_dir}: the weights are unreadable ({_first_line(exc)})") from exc
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        key, stored, expected = mismatched[0]
        raise ModelInvalid(
            f"{model_dir}: {len(mismatched)} tensors do not match config.json, first "
            f"{key}: {tuple(stored)} stored, {tuple(expected)} expected"
        )
    missing = sorted(info["missing_keys"])
    if missing:
        raise ModelInvalid(
            f"{model_dir}: the weights lack {len(missing)} tensors, first {missing[0]}"
        )
    model.eval().requires_grad_(False)
    return tokenizer, model


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
