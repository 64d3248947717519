"""The local engine's limits: requests in a pass and waiting, adapters held and their size,
prompt length, the prefix cache's size and the prompt tokens one pass computes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int = 16
    max_queue: int = 64
    max_rank: int = 64
    max_adapters: int = 32
    max_adapter_bytes: int = 512 * 2**20
    max_prompt_tokens: int = 4096
    max_prefix_cache_bytes: int = 256 * 2**20
    prefill_budget: int = 512  # prompt tokens one pass computes, padding of short rows included
