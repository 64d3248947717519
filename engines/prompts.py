"""Prompt token ids as both engines build them from the base model's tokenizer, so a turn reads
the same to the local engine and to the vLLM fleet."""

from __future__ import annotations

from typing import Any


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of plain text, as the model reads a prompt (special tokens added)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """Token ids of a conversation in the model's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return tuple(int(t) for t in ids["input_ids"])
