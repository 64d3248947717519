"""The local engine's prefix cache: the keys and values of prompts already computed, reused by
later prompts that begin the same way on the same adapter weights (the harness's system
prompt, an earlier turn of the conversation, the other samples of one prompt).

An entry is a copy of a prompt's keys and values as its request computed them (a request's
slot in the KV pool is reused once it ends). A new prompt takes a copy of the longest common
prefix among the entries for its adapter into its slot and computes only the rest. Entries are
evicted least recently used first when their bytes pass the cap, and dropped when their
adapter is unloaded."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engines.local.kv_pool import KVSlot
from engines.local.lora_layers import LoRAWeights
from infra.observe import prefix_cache_evictions, prefix_cache_hits

MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are cheaper to compute than to copy


@dataclass(eq=False)
class _Entry:
    adapter: LoRAWeights | None
    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _common_length(a: list[int], b: list[int]) -> int:
    for n, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return n
    return min(len(a), len(b))


class PrefixCache:
    """Prompt prefixes by adapter weights (compared by identity: a name unloaded and loaded
    again is other weights), up to ``max_bytes``. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: list[_Entry] = []  # least recently used first
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "tokens_reused": 0, "evictions": 0, "entries": 0, "bytes": 0}

    def load(self, adapter: LoRAWeights | None, prompt: list[int], slot: KVSlot) -> None:
        """Copy ``prompt``'s longest cached prefix (all but its last token at most, whose
        logits the caller needs) into the empty ``slot``; nothing when none is cached."""
        with self._lock:
            best, length = None, 0
            for entry in self._entries:
                if entry.adapter is adapter:
                    common = _common_length(entry.tokens, prompt)
                    if common > length:
                        best, length = entry, common
            length = min(length, len(prompt) - 1)
            if best is None or length < MIN_PREFIX_TOKENS:
                return
            self._entries.remove(best)
            self._entries.append(best)
            self.stats["hits"] += 1
            self.stats["tokens_reused"] += length
        prefix_cache_hits.add(1)
        slot.load([k[:, :, :length] for k in best.keys], [v[:, :, :length] for v in best.values])

    def add(self, adapter: LoRAWeights | None, prompt: list[int], slot: KVSlot) -> None:
        """Keep a copy of ``slot``'s first ``len(prompt)`` tokens as ``prompt``'s entry,
        replacing the entries it extends; nothing when an entry already covers the whole
        prompt."""
        if self.max_bytes <= 0 or len(prompt) < MIN_PREFIX_TOKENS or self._covered(adapter, prompt):
            return
        entry = _Entry(adapter, list(prompt), *slot.prefix(len(prompt)))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            shared = {
                id(e): _common_length(e.tokens, prompt)
                for e in self._entries
                if e.adapter is adapter
            }
            extended = {
                i for i, e in enumerate(self._entries) if shared.get(id(e)) == len(e.tokens)
            }
            self._entries = [e for i, e in enumerate(self._entries) if i not in extended]
            self._entries.append(entry)
            evicted = 0
            while self._bytes() > self.max_bytes:
                self._entries.pop(0)
                evicted += 1
            self.stats["evictions"] += evicted
            self._count()
        if evicted:
            prefix_cache_evictions.add(evicted)

    def _covered(self, adapter: LoRAWeights | None, prompt: list[int]) -> bool:
        with self._lock:
            return any(
                e.adapter is adapter and e.tokens[: len(prompt)] == prompt for e in self._entries
            )

    def invalidate(self, adapter_name: str) -> None:
        """Drop every entry computed with the adapter named ``adapter_name``."""
        with self._lock:
            self._entries = [
                e for e in self._entries if e.adapter is None or e.adapter.name != adapter_name
            ]
            self._count()

    def _bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def _count(self) -> None:
        self.stats["entries"] = len(self._entries)
        self.stats["bytes"] = self._bytes()
