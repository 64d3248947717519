"""Iteration-level batching for the local engine: one worker thread owns the model, admits
queued requests (each prompt in a pass of its own) and advances every active request by one
token per forward pass, whatever adapter it uses. Callers hand requests over through a bounded
queue and get chunks back on their own event loop. A request with a grammar has the tokens its
grammar forbids masked out of its row before sampling, and ends when the grammar is complete."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr

from core.engine import FinishReason, GenerationChunk, GenerationRequest, SamplingParams
from core.errors import EngineError, EngineOverloaded, EngineUnavailable, MacaronError
from server.engines.grammar import mask_rows, new_bitmask
from server.engines.llama import KVCache, forward
from server.engines.lora import BatchAdapters, LoRAWeights
from server.engines.prefixes import PrefixCache

KV_RESERVE = 128  # answer tokens a new request's KV cache has room for before it doubles


def _engine_error(exc: Exception) -> MacaronError:
    return exc if isinstance(exc, MacaronError) else EngineError(f"generation failed: {exc}")


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
    """One request on its way through the batch: its adapter, KV cache and output so far, and
    the queue on the caller's event loop that its chunks go to."""

    request: GenerationRequest
    adapter: LoRAWeights | None
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[GenerationChunk | BaseException]
    cancelled: threading.Event = field(default_factory=threading.Event)
    out_ids: list[int] = field(default_factory=list)
    cache: KVCache = field(default_factory=KVCache)
    emitted: str = ""
    generator: torch.Generator | None = None
    grammar: xgr.GrammarMatcher | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def send(self, item: GenerationChunk | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            self.cancelled.set()

    def visible_delta(self, text: str) -> str:
        """The new text safe to stream: what could still become a stop string, and
        half-decoded characters, are held back. Counted as emitted."""
        hold = max((len(s) - 1 for s in self.params.stop), default=0)
        visible = text[: len(text) - hold] if hold else text
        visible = visible.rstrip("\ufffd")
        delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted += delta
        return delta

    def finish(self, token: int, text: str, eos: set[int]) -> tuple[str, FinishReason | None]:
        """The decoded text cut at a stop string, and why generation ends (None: it goes on)."""
        params = self.params
        stop_at = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            return text[:stop_at], "stop"
        if self.grammar is not None and self.grammar.is_terminated():
            return text, "stop"
        if token in eos and not params.ignore_eos:
            return text, "stop"
        if len(self.out_ids) >= params.max_tokens:
            return text, "length"
        return text, None


class BatchScheduler:
    """The worker thread over ``model``: ``submit`` queues a ``Generation``, the worker streams
    its chunks back; ``release`` hands each finished request's adapter back to the engine."""

    def __init__(
        self,
        model: Any,
        adapters: BatchAdapters,
        tokenizer: Any,
        *,
        release: Callable[[LoRAWeights | None], None],
        prefixes: PrefixCache,
        max_batch: int,
        max_queue: int,
    ) -> None:
        self._model = model
        self._adapters = adapters
        self._tokenizer = tokenizer
        self._release = release
        self._prefixes = prefixes
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._eos = eos_ids(model)
        self._bitmask = new_bitmask(max_batch, model.config.vocab_size)
        self._pending: queue.Queue[Generation] = queue.Queue(max_queue)
        self._active: list[Generation] = []
        self.stats = {"max_batch": 0, "steps": 0, "tokens": 0, "cancelled": 0, "active": 0}
        self._stopping = threading.Event()
        self._worker = threading.Thread(target=self._run, name="macaron-engine", daemon=True)
        self._worker.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def submit(self, item: Generation) -> None:
        """Queue ``item`` for the worker; ``EngineOverloaded`` when the queue is full."""
        try:
            self._pending.put_nowait(item)
        except queue.Full:
            raise EngineOverloaded(
                f"the engine queue is full ({self._max_queue} waiting); retry shortly"
            ) from None

    def close(self) -> None:
        """Stop the worker; every request still queued or running gets ``EngineUnavailable``."""
        self._stopping.set()
        self._worker.join(timeout=30)
        closed = EngineUnavailable("the engine was shut down")
        for item in self._active:
            self._finish(item, "cancelled", error=closed)
        self._active = []
        while True:
            try:
                self._finish(self._pending.get_nowait(), "cancelled", error=closed)
            except queue.Empty:
                break

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping.is_set():
                try:
                    self._admit()
                    if self._active:
                        self._step()
                except Exception as exc:  # last resort: fail what is running, keep serving
                    for item in self._active:
                        self._finish(item, "cancelled", error=_engine_error(exc))
                    self._active = []
                self.stats["active"] = len(self._active)

    def _admit(self) -> None:
        """Take queued requests into the batch, each prompt in a pass of its own that begins
        after the longest prefix the prefix cache holds for it."""
        while len(self._active) < self._max_batch:
            try:
                item = self._pending.get(timeout=0.05 if not self._active else 0)
            except queue.Empty:
                return
            if item.cancelled.is_set():
                self._finish(item, "cancelled")
                continue
            try:
                capacity = len(item.prompt_ids) + min(item.params.max_tokens, KV_RESERVE)
                item.cache = self._prefixes.cache_for(item.adapter, item.prompt_ids, capacity)
                logits = self._forward([item], [item.prompt_ids[item.cache.length :]])
                self._prefixes.add(item.adapter, item.prompt_ids, item.cache)
                logits = self._constrain(logits, [item])
            except Exception as exc:  # one bad request must not stop the engine
                self._finish(item, "cancelled", error=_engine_error(exc))
                continue
            self._active.append(item)
            self._advance_safely(item, logits[0])

    def _step(self) -> None:
        """One token for every active request that is not cancelled, in one pass."""
        running = [r for r in self._active if not r.cancelled.is_set()]
        for item in self._active:
            if item.cancelled.is_set():
                self._finish(item, "cancelled")
        self._active = running
        if not running:
            return
        self.stats["max_batch"] = max(self.stats["max_batch"], len(running))
        self.stats["steps"] += 1
        try:
            logits = self._forward(running, [[r.out_ids[-1]] for r in running])
            logits = self._constrain(logits, running)
        except Exception as exc:  # fail this batch's requests, keep the engine serving
            self._active = []
            for item in running:
                self._finish(item, "cancelled", error=_engine_error(exc))
            return
        for item, row in zip(list(running), logits, strict=True):
            self._advance_safely(item, row)

    def _forward(self, items: list[Generation], tokens: list[list[int]]) -> torch.Tensor:
        self._adapters.assign([r.adapter for r in items])
        return forward(self._model, [r.cache for r in items], tokens)

    def _constrain(self, logits: torch.Tensor, items: list[Generation]) -> torch.Tensor:
        """``logits`` with each constrained row masked by its grammar (rows without one as
        they were): in float32, which the mask needs and greedy choice does not notice."""
        grammars = [r.grammar for r in items]
        if all(g is None for g in grammars):
            return logits
        logits = logits.float()
        mask_rows(logits, grammars, self._bitmask)
        return logits

    def _advance_safely(self, item: Generation, logits: torch.Tensor) -> None:
        try:
            self._advance(item, logits)
        except Exception as exc:  # e.g. NaN logits from a broken adapter: only this request
            if item in self._active:
                self._active.remove(item)
            self._finish(item, "cancelled", error=_engine_error(exc))

    def _advance(self, item: Generation, logits: torch.Tensor) -> None:
        """Sample the next token, then stream the text it completes or finish the request."""
        token = sample(logits, item.params, item.generator)
        item.out_ids.append(token)
        self.stats["tokens"] += 1
        if item.grammar is not None and not item.grammar.accept_token(token):
            raise EngineError(f"token {token} is outside the request's grammar")
        decoded = self._tokenizer.decode(item.out_ids, skip_special_tokens=True)
        text, finish = item.finish(token, decoded, self._eos)
        if finish is None:
            item.send(self._chunk(item, item.visible_delta(text), (token,), None))
            return
        delta = text[len(item.emitted) :] if text.startswith(item.emitted) else ""
        self._active.remove(item)
        self._finish(item, finish, delta=delta, tokens=(token,))

    def _chunk(
        self, item: Generation, text: str, tokens: tuple[int, ...], finish: FinishReason | None
    ) -> GenerationChunk:
        return GenerationChunk(
            request_id=item.request.request_id,
            text=text,
            token_ids=tokens,
            finish_reason=finish,
            prompt_tokens=len(item.prompt_ids),
            completion_tokens=len(item.out_ids),
        )

    def _finish(
        self,
        item: Generation,
        reason: FinishReason,
        *,
        delta: str = "",
        tokens: tuple[int, ...] = (),
        error: BaseException | None = None,
    ) -> None:
        """End ``item``: free its cache and adapter, and send its last chunk or its error."""
        item.cache.clear()
        if reason == "cancelled":
            self.stats["cancelled"] += 1
        self._release(item.adapter)
        item.adapter = None
        item.send(error if error is not None else self._chunk(item, delta, tokens, reason))
