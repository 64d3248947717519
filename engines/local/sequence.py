"""One request on its way through the local engine's batch: its adapter, KV slot, the answer
so far (decoded incrementally), what of it was streamed, and where its chunks go."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr

from core.engine import FinishReason, GenerationChunk, GenerationRequest, SamplingParams
from engines.local.detok import IncrementalText
from engines.local.kv_pool import KVSlot
from engines.local.lora_layers import LoRAWeights


def eos_ids(model: Any) -> set[int]:
    """The token ids that end an answer, from the model's generation config."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token: greedy at temperature 0, else from the top-p share of the softmax."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, 0) - ordered < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(eq=False)
class Generation:
    """A request in the batch. While its prompt is computed it may carry ``forks``: requests
    with the same prompt on the same adapter weights (the samples of one rollout group), which
    take a copy of its slot and ``prompt_logits`` when the prompt is done instead of computing
    it again."""

    request: GenerationRequest
    adapter: LoRAWeights | None
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[GenerationChunk | BaseException]
    detok: IncrementalText
    cancelled: threading.Event = field(default_factory=threading.Event)
    slot: KVSlot | None = None  # its keys and values, from its admission to its end
    forks: list[Generation] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None  # its prompt's last, once computed (for forks)
    emitted: int = 0  # characters of ``detok.text`` streamed so far
    generator: torch.Generator | None = None
    grammar: xgr.GrammarMatcher | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def out_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def prompt_done(self) -> bool:
        return self.computed >= len(self.prompt_ids)

    @property
    def computed(self) -> int:
        """Tokens its slot holds."""
        return self.slot.length if self.slot is not None else 0

    def same_prompt(self, other: Generation) -> bool:
        """Would ``other``'s prompt pass compute exactly this one's (a fork can share it)?"""
        return other.adapter is self.adapter and other.prompt_ids == self.prompt_ids

    def send(self, item: GenerationChunk | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            self.cancelled.set()

    def chunk(
        self, text: str, tokens: tuple[int, ...], finish: FinishReason | None
    ) -> GenerationChunk:
        return GenerationChunk(
            request_id=self.request.request_id,
            text=text,
            token_ids=tokens,
            finish_reason=finish,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.out_ids),
        )

    def append(self, token: int, eos: set[int]) -> tuple[str, FinishReason | None]:
        """Add ``token`` to the answer: the text now safe to stream (what could still become a
        stop string is held back) and, when the answer ends, why and its last text."""
        self.detok.append(token)
        text, finish = self._finish(token, eos)
        if finish is not None:
            delta = text[self.emitted :]
        else:
            hold = max((len(s) - 1 for s in self.params.stop), default=0)
            delta = text[self.emitted : max(self.emitted, len(text) - hold)]
        self.emitted += len(delta)
        return delta, finish

    def _finish(self, token: int, eos: set[int]) -> tuple[str, FinishReason | None]:
        """The text, cut at a stop string, and why generation ends (None: it goes on). Only
        the tail a new stop string could end in is searched."""
        params = self.params
        text = self.detok.text
        longest = max((len(s) for s in params.stop), default=0)
        since = max(0, self.emitted - longest)
        found = (text.find(s, since) for s in params.stop)
        stop_at = min((i for i in found if i >= 0), default=-1)
        if stop_at >= 0:
            return text[:stop_at], "stop"
        if self.grammar is not None and self.grammar.is_terminated():
            return self.detok.flush(), "stop"
        if token in eos and not params.ignore_eos:
            return self.detok.flush(), "stop"
        if len(self.out_ids) >= params.max_tokens:
            return self.detok.flush(), "length"
        return text, None


def prefill_rows(prefilling: list[Generation], budget: int) -> list[Generation]:
    """The prompts of the next pass, first come first: as many as fit ``budget`` tokens with
    each row padded to the longest chunk (a chunk is at most ``budget`` tokens)."""
    rows: list[Generation] = []
    longest = 0
    for item in prefilling:
        n = min(len(item.prompt_ids) - item.computed, budget)
        if rows and (len(rows) + 1) * max(longest, n) > budget:
            break
        rows.append(item)
        longest = max(longest, n)
    return rows
