"""Iteration-level batching for the local engine: one worker thread owns the model. Each turn
of its loop admits queued requests (each takes a slot of the worker's ``KVPool``), computes one
pass of prompts (several requests' prompts batched, a long prompt in chunks, within a budget of
tokens, so streaming answers never wait long for their next token) and advances every
answering request by one token, whatever adapter each uses. A request whose prompt and adapter
equal those of a request in the batch forks it: its slot takes a copy of that prompt's keys
and values, and it takes the prompt's last logits, not a pass of its own. Callers hand requests
over through a bounded queue and get chunks back on their own event loop. A request with a
grammar has the tokens its grammar forbids masked out of its row before sampling, and ends
when the grammar is complete."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from core.engine import FinishReason
from core.errors import EngineError, EngineOverloaded, EngineUnavailable, MacaronError
from engines.grammar import constrained, new_bitmask
from engines.local.decoder import forward
from engines.local.kv_pool import KVPool, KVSlot
from engines.local.limits import EngineLimits
from engines.local.lora_layers import BatchAdapters, LoRAWeights
from engines.local.prefixes import PrefixCache
from engines.local.sequence import Generation, eos_ids, prefill_rows, sample
from engines.local.threads import pin


def _engine_error(exc: Exception) -> MacaronError:
    return exc if isinstance(exc, MacaronError) else EngineError(f"generation failed: {exc}")


def _slot(item: Generation) -> KVSlot:
    if item.slot is None:
        raise EngineError("a request in the batch holds no KV slot")
    return item.slot


class BatchScheduler:
    """The worker thread over ``model``, computing on ``threads`` intra-op threads
    (``engines.local.threads``): ``submit`` queues a ``Generation``, the worker streams its chunks
    back; ``release`` hands each finished request's adapter back to the engine."""

    def __init__(
        self,
        model: Any,
        adapters: BatchAdapters,
        limits: EngineLimits,
        *,
        release: Callable[[LoRAWeights | None], None],
        prefixes: PrefixCache,
        threads: int,
    ) -> None:
        self._model = model
        self._threads = threads
        self._adapters = adapters
        self._release = release
        self._prefixes = prefixes
        self._max_batch = limits.max_batch
        self._max_queue = limits.max_queue
        self._prefill_budget = limits.prefill_budget
        self._eos = eos_ids(model)
        self._bitmask = new_bitmask(limits.max_batch, model.config.vocab_size)
        self._pool = KVPool(model, limits.max_batch)
        self._pending: queue.Queue[Generation] = queue.Queue(limits.max_queue)
        self._prefilling: list[Generation] = []  # prompts being computed, forks on each
        self._active: list[Generation] = []  # answering
        counters = ("max_batch", "steps", "tokens", "cancelled", "active", "threads")
        prefill = ("prefill_passes", "prefill_tokens", "forks")
        self.stats = dict.fromkeys((*counters, *prefill), 0)
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
        self._fail_all(closed)
        while True:
            try:
                self._finish(self._pending.get_nowait(), "cancelled", error=closed)
            except queue.Empty:
                break

    def _run(self) -> None:
        self.stats["threads"] = pin(self._threads)
        with torch.inference_mode():
            while not self._stopping.is_set():
                try:
                    self._admit()
                    if self._prefilling:
                        self._prefill()
                    if self._active:
                        self._step()
                except Exception as exc:  # last resort: fail what is running, keep serving
                    self._fail_all(_engine_error(exc))
                self.stats["active"] = len(self._active)

    def _fail_all(self, error: MacaronError) -> None:
        for item in self._active:
            self._finish(item, "cancelled", error=error)
        for item in self._prefilling:
            self._fail_group(item, error)
        self._active, self._prefilling = [], []

    def _in_flight(self) -> int:
        return len(self._active) + sum(1 + len(g.forks) for g in self._prefilling)

    def _admit(self) -> None:
        """Take queued requests into the batch: each forks the prompt being computed that it
        equals, or starts its own from the longest prefix the prefix cache holds for it."""
        while self._in_flight() < self._max_batch:
            idle = not self._active and not self._prefilling
            try:
                item = self._pending.get(timeout=0.05 if idle else 0)
            except queue.Empty:
                return
            if item.cancelled.is_set():
                self._finish(item, "cancelled")
                continue
            leader = next((g for g in self._prefilling if g.same_prompt(item)), None)
            source = next((g for g in self._active if g.same_prompt(item)), None)
            if leader is not None:
                leader.forks.append(item)
            elif source is not None:
                self._begin([item], source)
            if leader is not None or source is not None:
                self.stats["forks"] += 1
                continue
            try:
                item.slot = self._pool.acquire()
                self._prefixes.load(item.adapter, item.prompt_ids, item.slot)
            except Exception as exc:  # one bad request must not stop the engine
                self._finish(item, "cancelled", error=_engine_error(exc))
                continue
            self._prefilling.append(item)

    def _prefill(self) -> None:
        """One pass over the next prompt chunks; a request whose prompt is done starts
        answering (its forks with it)."""
        self._drop_cancelled_prefills()
        rows = prefill_rows(self._prefilling, self._prefill_budget)
        if not rows:
            return
        chunks = [r.prompt_ids[r.computed : r.computed + self._prefill_budget] for r in rows]
        try:
            logits = self._forward(rows, chunks)
        except Exception as exc:  # fail this pass's requests, keep the engine serving
            for item in rows:
                self._prefilling.remove(item)
                self._fail_group(item, _engine_error(exc))
            return
        self.stats["prefill_passes"] += 1
        self.stats["prefill_tokens"] += sum(len(c) for c in chunks)
        for item, row in zip(rows, logits, strict=True):
            if item.prompt_done:
                self._prefilling.remove(item)
                self._start(item, row)

    def _drop_cancelled_prefills(self) -> None:
        """Finish cancelled prompts and forks; a live fork of a cancelled prompt takes its
        slot over and goes on computing it."""
        kept = []
        for leader in self._prefilling:
            group = [leader, *leader.forks]
            live = [g for g in group if not g.cancelled.is_set()]
            if live and live[0] is not leader:
                live[0].slot, leader.slot = leader.slot, None
            leader.forks = []
            for item in group:
                if item.cancelled.is_set():
                    self._finish(item, "cancelled")
            if live:
                live[0].forks = live[1:]
                kept.append(live[0])
        self._prefilling = kept

    def _start(self, item: Generation, logits: torch.Tensor) -> None:
        """``item``'s prompt is computed: keep it in the prefix cache, and start it and its
        forks answering."""
        item.prompt_logits = logits
        group, item.forks = [item, *item.forks], []
        try:
            self._prefixes.add(item.adapter, item.prompt_ids, _slot(item))
        except Exception as exc:  # one bad request must not stop the engine
            for member in group:
                self._finish(member, "cancelled", error=_engine_error(exc))
            return
        self._begin(group, item)

    def _begin(self, members: list[Generation], source: Generation) -> None:
        """``members`` start answering from ``source``'s computed prompt: each but ``source``
        takes a slot holding a copy of its prompt's keys and values, and every one samples its
        first token from the prompt's last logits."""
        try:
            n, logits = len(source.prompt_ids), source.prompt_logits
            if logits is None:
                raise EngineError("a request was forked before its prompt was computed")
            for fork in members:
                if fork is not source:
                    fork.slot = self._pool.acquire()
                    fork.slot.copy_from(_slot(source), n)
            grammars = [m.grammar for m in members]
            rows = constrained(logits.repeat(len(members), 1), grammars, self._bitmask)
        except Exception as exc:  # one bad request must not stop the engine
            for member in members:
                self._finish(member, "cancelled", error=_engine_error(exc))
            return
        for member, row in zip(members, rows, strict=True):
            member.prompt_logits = logits  # each may be forked in turn
            self._active.append(member)
            self._advance_safely(member, row)

    def _fail_group(self, item: Generation, error: MacaronError) -> None:
        for member in (item, *item.forks):
            self._finish(member, "cancelled", error=error)
        item.forks = []

    def _step(self) -> None:
        """One token for every active request that is not cancelled, in one pass."""
        running = sorted(  # rows in slot order: one view of the pool's first slots
            (r for r in self._active if not r.cancelled.is_set()), key=lambda r: _slot(r).index
        )
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
            logits = constrained(logits, [r.grammar for r in running], self._bitmask)
        except Exception as exc:  # fail this batch's requests, keep the engine serving
            self._active = []
            for item in running:
                self._finish(item, "cancelled", error=_engine_error(exc))
            return
        for item, row in zip(list(running), logits, strict=True):
            self._advance_safely(item, row)

    def _forward(self, items: list[Generation], tokens: list[list[int]]) -> torch.Tensor:
        self._adapters.assign([r.adapter for r in items], max(len(t) for t in tokens))
        return forward(self._model, [_slot(r) for r in items], tokens)

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
        if item.grammar is not None and not item.grammar.accept_token(token):
            raise EngineError(f"token {token} is outside the request's grammar")
        delta, finish = item.append(token, self._eos)
        self.stats["tokens"] += 1
        if finish is None:
            item.send(item.chunk(delta, (token,), None))
            return
        self._active.remove(item)
        self._finish(item, finish, delta=delta, tokens=(token,))

    def _finish(
        self,
        item: Generation,
        reason: FinishReason,
        *,
        delta: str = "",
        tokens: tuple[int, ...] = (),
        error: BaseException | None = None,
    ) -> None:
        """End ``item``: free its slot and adapter, and send its last chunk or its error."""
        self._pool.release(item.slot)
        item.slot = None
        item.prompt_logits = None
        if reason == "cancelled":
            self.stats["cancelled"] += 1
        self._release(item.adapter)
        item.adapter = None
        item.send(error if error is not None else item.chunk(delta, tokens, reason))
