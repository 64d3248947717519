"""The local engine: one frozen base model, LoRA adapters loaded at run time, and
iteration-level batching (every active request advances one token per forward pass, whatever
adapter it uses; requests without an adapter ride in the same pass).

The batching lives in ``scheduler.py``, the forward pass in ``decoder.py``, loading and checking
the base model in ``base_model.py``; this module keeps the adapters within their limits and
turns requests into queued generations.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from pathlib import Path

import torch

from core.engine import ADAPTER_NAME, GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import (
    AdapterCapacityExceeded,
    AdapterInvalid,
    ContextLengthExceeded,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.adapter_table import AdapterTable
from engines.grammar import Grammars
from engines.local import threads
from engines.local.base_model import load_base_model
from engines.local.detok import IncrementalText
from engines.local.limits import EngineLimits
from engines.local.lora_layers import (
    AdapterConfig,
    BatchAdapters,
    LoRAWeights,
    adapter_dtype,
    check_rank,
    install,
    read_adapter,
    read_adapter_config,
)
from engines.local.prefixes import PrefixCache
from engines.local.scheduler import BatchScheduler
from engines.local.sequence import Generation, eos_ids
from engines.prompts import chat_prompt_ids, prompt_ids


class LocalEngine:
    """``Engine`` over a Hugging Face model folder of the Llama, Qwen2 or Mistral family, in
    ``dtype`` on ``device`` (``cpu``, or ``cuda`` for the GPU benchmark); sampling and grammars
    run on the CPU."""

    def __init__(
        self,
        model_dir: Path,
        *,
        limits: EngineLimits | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.limits = limits or EngineLimits()
        self.dtype, self.device = dtype, device
        self.tokenizer, self.model = load_base_model(model_dir, dtype)
        self.model.to(device)
        self._batch_adapters = batch = BatchAdapters(dtype=adapter_dtype(dtype, device))
        self._shapes = install(self.model, batch)
        self._adapters: AdapterTable[LoRAWeights] = AdapterTable()
        self._lock = threading.Lock()
        self.prefixes = PrefixCache(self.limits.max_prefix_cache_bytes)
        self._scheduler = BatchScheduler(
            self.model,
            batch,
            self.limits,
            release=self._release,
            prefixes=self.prefixes,
            threads=threads.hand_over(),
        )
        self.stats = self._scheduler.stats
        vocab = self.model.config.vocab_size
        self.grammars = Grammars(self.tokenizer, vocab, sorted(eos_ids(self.model)))

    # --- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Read a PEFT folder, making room first by evicting idle adapters, least recent first."""
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterInvalid(f"{name!r} is not a versioned adapter name such as coding@3")
        folder = Path(path)
        with self._lock:
            if self._adapters.serving(name):
                return  # versioned names are immutable: loaded once is loaded
        config = read_adapter_config(folder)
        check_rank(name, config, self.limits.max_rank)
        with self._lock:
            self._make_room(name, self._adapter_bytes(config))
        weights = read_adapter(
            name, folder, config, self._shapes, self._batch_adapters.dtype, self.device
        )
        with self._lock:
            self._make_room(name, weights.nbytes)
            self._adapters.put(name, weights)

    def _adapter_bytes(self, config: AdapterConfig) -> int:
        """What an adapter with ``config`` will take in memory, known before reading it."""
        element = torch.tensor([], dtype=self._batch_adapters.dtype).element_size()
        return sum(
            config.rank * (fan_in + fan_out) * element
            for (_, proj), (fan_in, fan_out) in self._shapes.items()
            if proj in config.targets
        )

    def _make_room(self, name: str, nbytes: int) -> None:
        """Evict least-recently-used idle adapters until ``nbytes`` more fit (lock held)."""
        cap = self.limits.max_adapter_bytes
        if nbytes > cap:
            raise AdapterCapacityExceeded(f"adapter {name} needs {nbytes} bytes; the cap is {cap}")
        while self._full(nbytes):
            idle = self._adapters.idle()
            if not idle:
                raise AdapterCapacityExceeded(
                    f"no room for adapter {name}: all {len(self._adapters)} loaded adapters "
                    "are serving requests"
                )
            self._adapters.evict(idle[0])
            self.prefixes.invalidate(idle[0])

    def _full(self, nbytes: int) -> bool:
        used = sum(w.nbytes for w in self._adapters.values())
        full = len(self._adapters) >= self.limits.max_adapters
        return full or used + nbytes > self.limits.max_adapter_bytes

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; requests in flight on it finish first."""
        with self._lock:
            self._adapters.unload(name)
        self.prefixes.invalidate(name)

    def loaded_adapters(self) -> list[str]:
        with self._lock:
            return self._adapters.names()

    def prepare(self, constraint: OutputConstraint) -> None:
        self.grammars.matcher(constraint)  # compiled and cached; the matcher itself is not kept

    def _acquire(self, name: str | None) -> LoRAWeights | None:
        if name is None:
            return None
        with self._lock:
            return self._adapters.acquire(name)

    def _release(self, weights: LoRAWeights | None) -> None:
        if weights is None:
            return
        with self._lock:
            self._adapters.release(weights.name)

    # --- requests ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return chat_prompt_ids(self.tokenizer, messages)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt served: the engine's limit, within the model's positions."""
        positions = getattr(self.model.config, "max_position_embeddings", None) or 2**31
        return min(self.limits.max_prompt_tokens, int(positions))

    def _checked_prompt(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids, within the prompt limit and the model's vocabulary."""
        prompt = (
            list(request.prompt)
            if isinstance(request.prompt, tuple)
            else self.encode(request.prompt)
        )
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if len(prompt) > self.max_prompt_tokens:
            raise ContextLengthExceeded(
                f"the context is {len(prompt)} tokens; this model takes at most "
                f"{self.max_prompt_tokens}: send a shorter message or fewer earlier ones"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return prompt

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Queue the request for the batch and stream its chunks; closing the stream cancels."""
        prompt = self._checked_prompt(request)
        if self._scheduler.stopping:
            raise EngineUnavailable("the engine was shut down")
        grammar = None
        if request.constraint is not None:  # compiling can take seconds: not on the loop
            grammar = await asyncio.to_thread(self.grammars.matcher, request.constraint)
        adapter = self._acquire(request.adapter)
        loop = asyncio.get_running_loop()
        detok = IncrementalText(self.tokenizer)
        item = Generation(request, adapter, prompt, loop, asyncio.Queue(), detok)
        item.grammar = grammar
        if request.params.seed is not None:
            item.generator = torch.Generator().manual_seed(request.params.seed)
        try:
            self._scheduler.submit(item)
        except EngineOverloaded:
            self._release(adapter)
            raise
        try:
            while True:
                chunk = await item.sink.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            item.cancelled.set()

    def close(self) -> None:
        """Stop the worker; every request still queued or running gets ``EngineUnavailable``."""
        self._scheduler.close()
        threads.take_back()
