"""The local engine's KV pool on a tiny random Llama: one decode call for rows in scattered
slots of different lengths (a slot between them held by a prompt being computed) attends each
row over exactly its own keys, also within a sliding window; a released slot is zeroed, so a
NaN its request left cannot reach the slot's next owner; the buffer grows keeping what it
holds, and is freed when no slot is held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from core.errors import EngineError
from engines.local.base_model import load_base_model
from engines.local.kv_pool import KVPool, KVSlot
from tests.numeric import assert_close

KV_HEADS, HEADS, HEAD_DIM = 2, 4, 16


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> object:
    _, loaded = load_base_model(tiny_model, torch.float32)
    config = loaded.config
    assert (config.num_key_value_heads, config.num_attention_heads) == (KV_HEADS, HEADS)
    assert config.hidden_size // HEADS == HEAD_DIM
    return loaded


def fill(slot: KVSlot, n: int, generator: torch.Generator) -> None:
    """Write ``n`` random tokens into every layer of ``slot``, as a prompt pass does."""
    slot.pool.reserve(slot.length + n)
    for layer in range(len(slot.pool.keys)):
        k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=generator) for _ in range(2))
        slot.extend(layer, k, v)
    slot.advance(n)


def exact(slot: KVSlot, layer: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
    """One row's attention over exactly its slot's tokens (the last ``window`` of them)."""
    n = slot.length
    first = 0 if window is None else max(0, n - window)
    keys = slot.pool.keys[layer][slot.index : slot.index + 1, :, first:n]
    values = slot.pool.values[layer][slot.index : slot.index + 1, :, first:n]
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


@pytest.mark.numeric
@pytest.mark.parametrize("window", [None, 5])
def test_one_decode_call_attends_each_row_over_its_own_keys(
    model: object, window: int | None
) -> None:
    """Each row's output is exact attention over its own slot, to float32's rounding (1 ulp
    seen). Guards the mask and the slot indexing: a row that skips its newest key, attends
    one key past its window, or reads another slot's keys is far off."""
    generator = torch.Generator().manual_seed(0)
    pool = KVPool(model, 4)
    slots = [pool.acquire() for _ in range(4)]
    for slot, n in zip(slots, (7, 30, 3, 12), strict=True):
        fill(slot, n, generator)
    rows = [slots[3], slots[0], slots[2]]  # slot 1 is a prompt still being computed
    q = torch.randn(len(rows), HEADS, 1, HEAD_DIM, generator=generator)
    k, v = (torch.randn(len(rows), KV_HEADS, 1, HEAD_DIM, generator=generator) for _ in range(2))
    with torch.inference_mode():
        got = pool.decode_attention(0, rows, q, (k, v), scale=HEAD_DIM**-0.5, window=window)
    for row, slot in enumerate(rows):
        slot.advance(1)  # what ``forward`` does once every layer has the pass
        assert torch.equal(pool.keys[0][slot.index, :, slot.length - 1], k[row, :, 0])
        want = exact(slot, 0, q[row : row + 1], window)
        assert_close(got[row : row + 1], want, ulps=16)
    assert slots[1].length == 30  # the row outside the call is left as it was


def test_a_released_slot_is_zeroed_and_its_next_owner_never_sees_a_nan(model: object) -> None:
    generator = torch.Generator().manual_seed(1)
    pool = KVPool(model, 2)
    poisoned, long = pool.acquire(), pool.acquire()
    fill(long, 40, generator)
    pool.reserve(40)
    for layer in range(len(pool.keys)):
        nan = torch.full((1, KV_HEADS, 20, HEAD_DIM), float("nan"))
        poisoned.extend(layer, nan, nan)
    poisoned.advance(20)
    pool.release(poisoned)
    fresh = pool.acquire()
    assert fresh.index == poisoned.index and fresh.length == 0
    assert not pool.keys[0][fresh.index].isnan().any()
    fill(fresh, 4, generator)
    q = torch.randn(2, HEADS, 1, HEAD_DIM, generator=generator)
    k, v = (torch.randn(2, KV_HEADS, 1, HEAD_DIM, generator=generator) for _ in range(2))
    with torch.inference_mode():  # the short row is masked over the long row's 41 positions
        got = pool.decode_attention(0, [fresh, long], q, (k, v), scale=HEAD_DIM**-0.5, window=None)
    assert not got.isnan().any()


def test_the_pool_grows_keeping_its_tokens_and_is_freed_when_idle(model: object) -> None:
    generator = torch.Generator().manual_seed(2)
    pool = KVPool(model, 8)
    first = pool.acquire()
    fill(first, 10, generator)
    kept = first.prefix(10)
    others = [pool.acquire() for _ in range(4)]  # 1 -> 2 -> 4 -> 8 slots
    pool.reserve(pool.capacity + 1)
    assert pool.keys[0].shape[0] == 8 and pool.capacity > 10
    assert all(torch.equal(a, b) for a, b in zip(first.prefix(10)[0], kept[0], strict=True))
    others += [pool.acquire() for _ in range(3)]
    with pytest.raises(EngineError) as refused:
        pool.acquire()
    assert refused.value.code == "engine_error"
    assert pool.keys[0].shape[0] == 8  # refused, not grown past max_slots
    pool.release(first)
    again = pool.acquire()
    assert again.index == 0  # the lowest free slot
    for slot in others:
        pool.release(slot)
    assert pool.keys != []
    pool.release(again)
    assert pool.keys == [] and pool.capacity == 0
