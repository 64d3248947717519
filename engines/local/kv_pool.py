"""The local engine's keys and values: one buffer per layer for the whole batch, shaped
``(slots, kv_heads, capacity, head_dim)``, where a request owns one slot (a row) from its
admission to its end. A decode pass writes every row's new key and value in one indexed copy
per layer and attends over all rows in one call (``decode_attention``), reading the buffer
itself: a view when the answering rows hold the first slots, as they mostly do, since a new
request takes the lowest free slot. A prompt's chunk attends over its own slot's view.

The buffer grows (slots doubling up to the batch limit, capacity doubling past the longest
row) and is dropped when no slot is held, so an idle engine holds no KV memory.

A position past a row's length is masked, yet still enters the attention's products as
0 x value, and 0 x NaN is NaN: so the buffer starts zeroed and a released slot's tokens are
zeroed again (a request whose hidden state went NaN would otherwise poison the masked tail of
its slot's next owner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from core.errors import EngineError

GROWTH_RESERVE = 128  # positions a grown buffer has past the longest row, before it doubles


@dataclass(eq=False)
class KVSlot:
    """A request's row of the pool, and how many tokens every layer holds there."""

    pool: KVPool
    index: int
    length: int = 0

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's ``k``/``v`` (``(1, kv_heads, n, head_dim)``) after the slot's
        tokens in ``layer``; views of that layer's keys and values so far. ``advance`` counts
        the pass once every layer has it."""
        end = self.length + k.shape[2]
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[self.index, :, self.length : end] = k[0]
        values[self.index, :, self.length : end] = v[0]
        row = slice(self.index, self.index + 1)
        return keys[row, :, :end], values[row, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold a computed prefix: per-layer ``(1, kv_heads, n, head_dim)`` copies in."""
        n = keys[0].shape[2]
        self.pool.reserve(n)
        for mine, theirs in zip(self.pool.keys, keys, strict=True):
            mine[self.index, :, :n] = theirs[0]
        for mine, theirs in zip(self.pool.values, values, strict=True):
            mine[self.index, :, :n] = theirs[0]
        self.length = n

    def copy_from(self, source: KVSlot, length: int) -> None:
        """Hold ``source``'s first ``length`` tokens (a fork of its computed prompt)."""
        for buffer in (*self.pool.keys, *self.pool.values):
            buffer[self.index, :, :length] = buffer[source.index, :, :length]
        self.length = length

    def prefix(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of every layer's first ``length`` keys and values, ``(1, kv_heads, length,
        head_dim)`` each: they outlive the slot."""
        row = slice(self.index, self.index + 1)
        return (
            [k[row, :, :length].clone() for k in self.pool.keys],
            [v[row, :, :length].clone() for v in self.pool.values],
        )


class KVPool:
    """The batch's KV buffers for ``model`` (its layer count, KV heads, head size, dtype and
    device), for at most ``max_slots`` requests at once. Used by the engine's worker thread
    only."""

    def __init__(self, model: Any, max_slots: int) -> None:
        config = model.config
        heads = config.num_attention_heads
        self._layers = config.num_hidden_layers
        self._kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        weight = model.model.embed_tokens.weight
        self._dtype, self._device = weight.dtype, weight.device
        self.max_slots = max_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._held: list[KVSlot | None] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def acquire(self) -> KVSlot:
        """The lowest free slot, the buffer growing when every slot is held."""
        free = next((i for i, s in enumerate(self._held) if s is None), len(self._held))
        if free >= self.max_slots:
            raise EngineError(f"every one of the {self.max_slots} KV slots is held")
        if free == len(self._held):
            self._grow(min(self.max_slots, max(1, 2 * len(self._held))), self.capacity)
        slot = KVSlot(self, free)
        self._held[free] = slot
        return slot

    @torch.inference_mode()  # also called by ``close`` on the caller's thread
    def release(self, slot: KVSlot | None) -> None:
        """Free ``slot`` (its tokens zeroed); the buffer goes when no slot is held."""
        if slot is None or self._held[slot.index] is not slot:
            return
        for buffer in (*self.keys, *self.values):
            buffer[slot.index, :, : slot.length].zero_()
        self._held[slot.index] = None
        slot.length = 0
        if all(s is None for s in self._held):
            self.keys, self.values, self._held = [], [], []

    def reserve(self, length: int) -> None:
        """Room for ``length`` tokens in every slot."""
        if length > self.capacity:
            self._grow(len(self._held), max(length + GROWTH_RESERVE, 2 * self.capacity))

    def _grow(self, slots: int, capacity: int) -> None:
        shape = (slots, self._kv_heads, capacity, self._head_dim)
        old_slots, old_capacity = len(self._held), self.capacity
        grown: list[list[torch.Tensor]] = [[], []]
        for old, new in zip((self.keys, self.values), grown, strict=True):
            for _ in range(self._layers):
                new.append(torch.zeros(shape, dtype=self._dtype, device=self._device))
            for index, buffer in enumerate(old):
                new[index][:old_slots, :, :old_capacity] = buffer
        self.keys, self.values = grown
        self._held.extend([None] * (slots - old_slots))

    def decode_attention(
        self,
        layer: int,
        slots: list[KVSlot],
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        *,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """One decode pass's attention in ``layer``: every row's ``q`` (``(rows, heads, 1,
        head_dim)``) over its slot's keys and values, after writing this pass's ``kv`` (one
        token a row) at its slot's length, in one call. A key head's query heads go in as that
        head's query positions (grouped-query attention without repeating keys: in bf16 it is
        several times faster on the CPU than SDPA's ``enable_gqa``). Rows holding slots
        outside ``slots`` (prompts being computed, free slots) take part with a zero query, and
        their output is dropped."""
        rows, heads, _, head_dim = q.shape
        index = torch.tensor([s.index for s in slots], device=q.device)
        lengths = torch.tensor([s.length for s in slots], device=q.device)
        keys, values = self.keys[layer], self.values[layer]
        keys[index, :, lengths] = kv[0][:, :, 0]
        values[index, :, lengths] = kv[1][:, :, 0]
        span = max(s.index for s in slots) + 1
        seen = int(lengths.max()) + 1
        dense = span == rows and all(s.index == i for i, s in enumerate(slots))
        grouped = q.reshape(rows, self._kv_heads, heads // self._kv_heads, head_dim)
        if not dense:
            grouped = grouped.new_zeros((span, *grouped.shape[1:])).index_copy_(0, index, grouped)
        position = torch.arange(seen, device=q.device)[None, :]
        ends = torch.ones(span, dtype=torch.long, device=q.device).index_copy_(
            0, index, lengths + 1
        )
        mask = position < ends[:, None]
        if window is not None:
            mask &= position >= ends[:, None] - window
        attended = F.scaled_dot_product_attention(
            grouped,
            keys[:span, :, :seen],
            values[:span, :, :seen],
            attn_mask=mask[:, None, None, :],
            scale=scale,
        )
        if not dense:
            attended = attended.index_select(0, index)
        return attended.reshape(rows, heads, 1, head_dim)
