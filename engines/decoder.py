"""The local engine's forward pass over a Hugging Face decoder of the Llama, Qwen2 (biased QKV)
or Mistral family (a sliding attention window where the config names one): linear layers run
batched across requests (``MultiLoRALinear`` applies each row's adapter), attention runs per
request over that request's own KV cache, so no padding enters the maths and each request
computes what it would compute alone. Rows may carry different numbers of tokens (prompt
chunks of several requests in one pass): the shorter are padded, and the padding is sliced
off before each attention."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for every position of the pass


class KVCache:
    """One request's keys and values, per layer in a buffer ``(1, kv_heads, capacity,
    head_dim)`` written in place; a full buffer doubles, so a token costs no concatenation."""

    def __init__(self, capacity: int = 0) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0  # tokens every layer holds
        self.capacity_hint = capacity

    @classmethod
    def of_prefix(
        cls, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int
    ) -> KVCache:
        """A cache holding copies of per-layer ``keys``/``values`` (all the same length)."""
        cache = cls(capacity)
        length = keys[0].shape[2] if keys else 0
        for k, v in zip(keys, values, strict=True):
            cache.keys.append(cache._buffer(k, max(capacity, length)))
            cache.values.append(cache._buffer(v, max(capacity, length)))
        cache.length = length
        return cache

    @staticmethod
    def _buffer(filled: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (*filled.shape[:2], capacity, filled.shape[3])
        buffer = filled.new_empty(shape)
        buffer[:, :, : filled.shape[2]] = filled
        return buffer

    def extend(
        self, index: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's ``k``/``v`` after the cached tokens of layer ``index``; that
        layer's keys and values so far. ``advance`` counts the pass once every layer has it."""
        start, end = self.length, self.length + k.shape[2]
        if index == len(self.keys):
            capacity = max(end, self.capacity_hint)
            self.keys.append(k.new_empty((*k.shape[:2], capacity, k.shape[3])))
            self.values.append(v.new_empty((*v.shape[:2], capacity, v.shape[3])))
        elif end > self.keys[index].shape[2]:
            capacity = max(end, 2 * self.keys[index].shape[2])
            self.keys[index] = self._buffer(self.keys[index][:, :, :start], capacity)
            self.values[index] = self._buffer(self.values[index][:, :, :start], capacity)
        self.keys[index][:, :, start:end] = k
        self.values[index][:, :, start:end] = v
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def prefix(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of every layer's first ``length`` keys and values."""
        return (
            [k[:, :, :length].clone() for k in self.keys],
            [v[:, :, :length].clone() for v in self.values],
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def clear(self) -> None:
        self.keys, self.values, self.length = [], [], 0


def forward(model: Any, caches: list[KVCache], tokens: list[list[int]]) -> torch.Tensor:
    """One pass: ``tokens`` per request (a prompt's chunk, or one answer token), continuing
    and extending each request's cache in place. Rows shorter than the longest are padded;
    padding never enters a cache or an attention. Returns each row's last token's logits, in
    float32 on the CPU."""
    inner = model.model
    lengths = [len(t) for t in tokens]
    steps = max(lengths)
    device = inner.embed_tokens.weight.device
    ids = torch.tensor([t + [0] * (steps - len(t)) for t in tokens], device=device)
    positions = torch.tensor(
        [list(range(c.length, c.length + steps)) for c in caches], device=device
    )
    hidden = inner.embed_tokens(ids)
    rotary: Rotary = inner.rotary_emb(hidden, positions)
    for index, layer in enumerate(inner.layers):
        window = attention_window(model.config, layer.self_attn)
        hidden = _decoder_layer(layer, index, hidden, rotary, caches, lengths, window)
    for cache, length in zip(caches, lengths, strict=True):
        cache.advance(length)
    last = hidden[torch.arange(len(tokens)), torch.tensor(lengths) - 1]
    logits: torch.Tensor = model.lm_head(inner.norm(last[:, None, :]))[:, -1, :]
    # Sampling and grammar masks work on the CPU in float32, whatever the model's device and dtype.
    return logits.float().cpu()


def attention_window(config: Any, attn: Any) -> int | None:
    """How many positions (itself included) a token of this layer sees, or ``None``: all.
    Qwen2 sets it per layer on the attention module (its ``layer_types``); Mistral sets one for
    every layer in its config; Llama has none."""
    if hasattr(attn, "sliding_window"):
        window: int | None = attn.sliding_window
        return window
    return getattr(config, "sliding_window", None)


def _decoder_layer(
    layer: Any,
    index: int,
    hidden: torch.Tensor,
    rotary: Rotary,
    caches: list[KVCache],
    lengths: list[int],
    window: int | None,
) -> torch.Tensor:
    """Layer ``index``: batched projections and MLP, attention request by request over each
    row's own tokens."""
    attn = layer.self_attn
    batch, steps = hidden.shape[0], hidden.shape[1]
    x = layer.input_layernorm(hidden)
    shape = (batch, steps, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rotary)
    ragged = min(lengths) < steps
    attended = q.new_zeros(q.shape) if ragged else None
    outputs = []
    for row, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        start = cache.length
        keys, values = cache.extend(index, k[row : row + 1, :, :n], v[row : row + 1, :, :n])
        out = _attend(attn, q[row : row + 1, :, :n], keys, values, start, window)
        if attended is None:
            outputs.append(out)
        else:
            attended[row, :, :n] = out[0]
    merged = attended if attended is not None else torch.cat(outputs)
    hidden = hidden + attn.o_proj(merged.transpose(1, 2).reshape(batch, steps, -1))
    result: torch.Tensor = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return result


def _attend(
    attn: Any,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
) -> torch.Tensor:
    """One request's attention: each of ``q``'s positions (after ``start`` cached tokens) sees
    the cache and itself and the positions before it in this pass; with a ``window``, only the
    last ``window`` of those (the keys stay cached whole: the window only masks)."""
    steps = q.shape[2]
    mask = None
    if window is not None and start + steps > window:
        query = torch.arange(start, start + steps, device=q.device)[:, None]
        key = torch.arange(start + steps, device=q.device)[None, :]
        mask = (key <= query) & (key > query - window)
    elif steps > 1 and start > 0:  # causal, aligned to the end: a prefill after a cached prefix
        mask = torch.ones(steps, start + steps, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=start)
    attended: torch.Tensor = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None and steps > 1 and start == 0,
        scale=attn.scaling,
        enable_gqa=True,
    )
    return attended
