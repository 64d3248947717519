"""Tokenising for the recipe: a turn as the engine prompts it with the answer to learn, right-
padded batches, and shuffled passes over the examples."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from core.events import ChatMessage

IGNORE = -100  # label of a token that carries no loss (prompt and padding)


@dataclass(frozen=True)
class Tokenized:
    """Token ids of prompt + answer; ``labels`` is ``IGNORE`` except on the answer's tokens."""

    ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The tokens the chat template puts after an assistant answer, up to and including the
    token that stops generation (``<|im_end|>`` for SmolLM2): what the model must learn to
    emit when its answer is done. Anything the template adds after it (a newline) is never
    generated, so it is not learned either."""
    probe = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*probe, {"role": "assistant", "content": "y"}], tokenize=False
    )
    eos = tokenizer.eos_token_id
    if full.startswith(prompt + "y"):
        ids = list(tokenizer(full[len(prompt) + 1 :], add_special_tokens=False)["input_ids"])
        if eos in ids:
            return ids[: ids.index(eos) + 1]
    return [eos]  # a template that ends turns without the EOS token


def tokenize_turn(
    tokenizer: Any,
    messages: list[ChatMessage],
    answer: str,
    end_of_turn: list[int],
    max_length: int,
) -> Tokenized:
    """The prompt exactly as the engine builds it (chat template with the generation prompt),
    then the answer and the end of turn; loss falls on the answer and end of turn only.
    Too long a sequence loses its oldest context, keeping the answer that is being taught."""
    chat = [m.model_dump() for m in messages]
    prompt = list(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    target = [*tokenizer(answer, add_special_tokens=False)["input_ids"], *end_of_turn]
    ids = [*prompt, *target][-max_length:]
    labels = ([IGNORE] * len(prompt) + target)[-max_length:]
    return Tokenized(ids, labels)


def collate(items: list[Tokenized], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """Right-pad to the longest sequence; padding is masked out of attention and loss. The
    batch is built on the CPU and moved to ``device`` whole."""
    width = max(len(item.ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item.ids)] = torch.tensor(item.ids)
        labels[row, : len(item.labels)] = torch.tensor(item.labels)
        mask[row, : len(item.ids)] = 1
    return Batch(ids.to(device), mask.to(device), labels.to(device))


class Shuffled:
    """Endless shuffled passes over ``size`` items: every item is drawn once per pass, so a
    small dataset is covered evenly rather than by chance."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.rng = rng
        self.queue: list[int] = []

    def draw(self, n: int) -> list[int]:
        drawn: list[int] = []
        while len(drawn) < n:
            if not self.queue:
                self.queue = list(range(self.size))
                self.rng.shuffle(self.queue)
            drawn.append(self.queue.pop())
        return drawn
