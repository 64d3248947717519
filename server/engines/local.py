"""The local engine: one frozen base model, LoRA adapters loaded at run time, and
iteration-level batching (every active request advances one token per forward pass, whatever
adapter it uses; requests without an adapter ride in the same pass).

Linear layers run batched across requests (``MultiLoRALinear`` applies each row's adapter);
attention runs per request over that request's own KV cache, so no padding enters the maths and
each request computes what it would compute alone. One worker thread owns the model; callers
talk to it through a bounded queue and get tokens back on their event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from core.engine import (
    ADAPTER_NAME,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from core.errors import (
    AdapterCapacityExceeded,
    AdapterInvalid,
    AdapterNotFound,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    MacaronError,
    ModelUnavailable,
)
from server.engines.lora import (
    BatchAdapters,
    LoRAWeights,
    check_rank,
    install,
    read_adapter,
    read_adapter_config,
)

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (1, kv_heads, length, head_dim)


def _engine_error(exc: Exception) -> MacaronError:
    return exc if isinstance(exc, MacaronError) else EngineError(f"generation failed: {exc}")


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of plain text, as the model reads a prompt (special tokens added)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...]:
    """Token ids of a conversation in the model's chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return tuple(int(t) for t in ids["input_ids"])


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 16
    max_queue: int = 64
    max_rank: int = 64
    max_adapters: int = 32
    max_adapter_bytes: int = 512 * 2**20
    max_prompt_tokens: int = 4096


@dataclass(eq=False)
class _Request:
    request: GenerationRequest
    adapter: LoRAWeights | None
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue[GenerationChunk | BaseException]
    cancelled: threading.Event = field(default_factory=threading.Event)
    out_ids: list[int] = field(default_factory=list)
    cache: KVCache = field(default_factory=list)
    emitted: str = ""
    generator: torch.Generator | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def send(self, item: GenerationChunk | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone: nobody is listening any more
            self.cancelled.set()


class LocalEngine:
    """``Engine`` over a Hugging Face Llama-family model folder."""

    def __init__(
        self,
        model_dir: Path,
        *,
        limits: EngineLimits | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.limits = limits or EngineLimits()
        self.dtype = dtype
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
            self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelUnavailable(f"cannot load the base model from {model_dir}: {exc}") from exc
        if self.model.config.model_type != "llama":
            raise ModelUnavailable(f"{self.model.config.model_type} models are not supported")
        self.model.eval().requires_grad_(False)
        self._batch = BatchAdapters()
        self._shapes = install(self.model, self._batch)
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._adapters: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recent first
        self._in_use: dict[str, int] = {}
        self._retired: set[str] = set()
        self._lock = threading.Lock()
        self._pending: queue.Queue[_Request] = queue.Queue(self.limits.max_queue)
        self._active: list[_Request] = []
        self.stats = {"max_batch": 0, "steps": 0, "tokens": 0, "cancelled": 0, "active": 0}
        self._stopping = threading.Event()
        self._worker = threading.Thread(target=self._run, name="macaron-engine", daemon=True)
        self._worker.start()

    # --- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterInvalid(f"{name!r} is not a versioned adapter name such as coding@3")
        folder = Path(path)
        with self._lock:
            if name in self._adapters and name not in self._retired:
                return  # versioned names are immutable: loaded once is loaded
        config = read_adapter_config(folder)
        check_rank(name, config, self.limits.max_rank)
        element = torch.tensor([], dtype=self.dtype).element_size()
        needed = sum(
            config.rank * (fan_in + fan_out) * element
            for (_, proj), (fan_in, fan_out) in self._shapes.items()
            if proj in config.targets
        )
        with self._lock:
            self._make_room(name, needed)
        weights = read_adapter(name, folder, config, self._shapes, self.dtype)
        with self._lock:
            self._make_room(name, weights.nbytes)
            self._adapters[name] = weights
            self._retired.discard(name)

    def _make_room(self, name: str, nbytes: int) -> None:
        """Evict least-recently-used idle adapters until ``nbytes`` more fit (lock held)."""
        if nbytes > self.limits.max_adapter_bytes:
            raise AdapterCapacityExceeded(
                f"adapter {name} needs {nbytes} bytes; the cap is {self.limits.max_adapter_bytes}"
            )

        def over() -> bool:
            used = sum(w.nbytes for w in self._adapters.values())
            full = len(self._adapters) >= self.limits.max_adapters
            return full or used + nbytes > self.limits.max_adapter_bytes

        while over():
            idle = [n for n in self._adapters if not self._in_use.get(n)]
            if not idle:
                raise AdapterCapacityExceeded(
                    f"no room for adapter {name}: all {len(self._adapters)} loaded adapters "
                    "are serving requests"
                )
            del self._adapters[idle[0]]
            self._retired.discard(idle[0])

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters or name in self._retired:
                raise AdapterNotFound(f"adapter {name} is not loaded")
            if self._in_use.get(name):
                self._retired.add(name)  # freed when its last request finishes
            else:
                del self._adapters[name]

    def loaded_adapters(self) -> list[str]:
        with self._lock:
            return [n for n in self._adapters if n not in self._retired]

    def _acquire(self, name: str | None) -> LoRAWeights | None:
        if name is None:
            return None
        with self._lock:
            weights = self._adapters.get(name)
            if weights is None or name in self._retired:
                raise AdapterNotFound(f"adapter {name} is not loaded")
            self._adapters.move_to_end(name)
            self._in_use[name] = self._in_use.get(name, 0) + 1
            return weights

    def _release(self, weights: LoRAWeights | None) -> None:
        if weights is None:
            return
        with self._lock:
            self._in_use[weights.name] -= 1
            if not self._in_use[weights.name]:
                del self._in_use[weights.name]
                if weights.name in self._retired:
                    self._retired.discard(weights.name)
                    self._adapters.pop(weights.name, None)

    # --- requests ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return prompt_ids(self.tokenizer, text)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return chat_prompt_ids(self.tokenizer, messages)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        prompt = (
            list(request.prompt)
            if isinstance(request.prompt, tuple)
            else self.encode(request.prompt)
        )
        if not prompt or len(prompt) > self.limits.max_prompt_tokens:
            raise ValueError(f"prompt must be 1 to {self.limits.max_prompt_tokens} tokens")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if self._stopping.is_set():
            raise EngineUnavailable("the engine was shut down")
        adapter = self._acquire(request.adapter)
        loop = asyncio.get_running_loop()
        item = _Request(request, adapter, prompt, loop, asyncio.Queue())
        if request.params.seed is not None:
            item.generator = torch.Generator().manual_seed(request.params.seed)
        try:
            self._pending.put_nowait(item)
        except queue.Full:
            self._release(adapter)
            raise EngineOverloaded(
                f"the engine queue is full ({self.limits.max_queue} waiting); retry shortly"
            ) from None
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

    # --- the worker -------------------------------------------------------------------------

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
        while len(self._active) < self.limits.max_batch:
            try:
                item = self._pending.get(timeout=0.05 if not self._active else 0)
            except queue.Empty:
                return
            if item.cancelled.is_set():
                self._finish(item, "cancelled")
                continue
            try:
                logits = self._forward([item], [item.prompt_ids])
            except Exception as exc:  # one bad request must not stop the engine
                self._finish(item, "cancelled", error=_engine_error(exc))
                continue
            self._active.append(item)
            self._advance_safely(item, logits[0])

    def _step(self) -> None:
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
        except Exception as exc:  # fail this batch's requests, keep the engine serving
            self._active = []
            for item in running:
                self._finish(item, "cancelled", error=_engine_error(exc))
            return
        for item, row in zip(list(running), logits, strict=True):
            self._advance_safely(item, row)

    def _advance_safely(self, item: _Request, logits: torch.Tensor) -> None:
        try:
            self._advance(item, logits)
        except Exception as exc:  # e.g. NaN logits from a broken adapter: only this request
            if item in self._active:
                self._active.remove(item)
            self._finish(item, "cancelled", error=_engine_error(exc))

    def _forward(self, items: list[_Request], tokens: list[list[int]]) -> torch.Tensor:
        """One pass: ``tokens`` per request (all the same length), continuing each request's
        cache. Returns the last position's logits per request."""
        model = self.model.model
        self._batch.assign([r.adapter for r in items])
        ids = torch.tensor(tokens)
        steps = ids.shape[1]
        starts = [r.cache[0][0].shape[2] if r.cache else 0 for r in items]
        positions = torch.tensor([list(range(s, s + steps)) for s in starts])
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, positions)
        batch = len(items)
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            residual = hidden
            x = layer.input_layernorm(hidden)
            shape = (batch, steps, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            outputs = []
            for row, item in enumerate(items):
                k_row, v_row = k[row : row + 1], v[row : row + 1]
                if len(item.cache) > index:
                    past_k, past_v = item.cache[index]
                    k_row, v_row = torch.cat([past_k, k_row], 2), torch.cat([past_v, v_row], 2)
                    item.cache[index] = (k_row, v_row)
                else:
                    item.cache.append((k_row, v_row))
                outputs.append(
                    F.scaled_dot_product_attention(
                        q[row : row + 1],
                        k_row,
                        v_row,
                        is_causal=steps > 1,
                        scale=attn.scaling,
                        enable_gqa=True,
                    )
                )
            attended = torch.cat(outputs).transpose(1, 2).reshape(batch, steps, -1)
            hidden = residual + attn.o_proj(attended)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = model.norm(hidden[:, -1:, :])
        logits: torch.Tensor = self.model.lm_head(hidden)[:, -1, :]
        return logits

    def _sample(self, item: _Request, logits: torch.Tensor) -> int:
        params = item.params
        if params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, 0) - ordered < params.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return int(torch.multinomial(probs, 1, generator=item.generator))

    def _advance(self, item: _Request, logits: torch.Tensor) -> None:
        token = self._sample(item, logits)
        item.out_ids.append(token)
        self.stats["tokens"] += 1
        text = self.tokenizer.decode(item.out_ids, skip_special_tokens=True)
        finish: FinishReason | None = None
        stop_at = min((i for i in (text.find(s) for s in item.params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            text, finish = text[:stop_at], "stop"
        elif token in self._eos and not item.params.ignore_eos:
            finish = "stop"
        elif len(item.out_ids) >= item.params.max_tokens:
            finish = "length"
        if finish is None:
            # Hold back what could still become a stop string, and half-decoded characters.
            hold = max((len(s) - 1 for s in item.params.stop), default=0)
            visible = text[: len(text) - hold] if hold else text
            visible = visible.rstrip("\ufffd")
            delta = visible[len(item.emitted) :] if visible.startswith(item.emitted) else ""
            item.emitted += delta
            item.send(self._chunk(item, delta, (token,), None))
            return
        delta = text[len(item.emitted) :] if text.startswith(item.emitted) else ""
        self._active.remove(item)
        self._finish(item, finish, delta=delta, tokens=(token,))

    def _chunk(
        self, item: _Request, text: str, tokens: tuple[int, ...], finish: FinishReason | None
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
        item: _Request,
        reason: FinishReason,
        *,
        delta: str = "",
        tokens: tuple[int, ...] = (),
        error: BaseException | None = None,
    ) -> None:
        item.cache.clear()
        if reason == "cancelled":
            self.stats["cancelled"] += 1
        self._release(item.adapter)
        item.adapter = None
        item.send(error if error is not None else self._chunk(item, delta, tokens, reason))
