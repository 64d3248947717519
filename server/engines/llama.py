"""The local engine's forward pass over a Hugging Face Llama-family model: linear layers run
batched across requests (``MultiLoRALinear`` applies each row's adapter), attention runs per
request over that request's own KV cache, so no padding enters the maths and each request
computes what it would compute alone."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (1, kv_heads, length, head_dim)
Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for every position of the pass


def forward(model: Any, caches: list[KVCache], tokens: list[list[int]]) -> torch.Tensor:
    """One pass: ``tokens`` per request (all the same length), continuing and extending each
    request's cache in place. Returns the last position's logits per request."""
    inner = model.model
    ids = torch.tensor(tokens)
    steps = ids.shape[1]
    starts = [cache[0][0].shape[2] if cache else 0 for cache in caches]
    positions = torch.tensor([list(range(s, s + steps)) for s in starts])
    hidden = inner.embed_tokens(ids)
    rotary: Rotary = inner.rotary_emb(hidden, positions)
    for index, layer in enumerate(inner.layers):
        hidden = _decoder_layer(layer, index, hidden, rotary, caches)
    hidden = inner.norm(hidden[:, -1:, :])
    logits: torch.Tensor = model.lm_head(hidden)[:, -1, :]
    return logits


def _decoder_layer(
    layer: Any, index: int, hidden: torch.Tensor, rotary: Rotary, caches: list[KVCache]
) -> torch.Tensor:
    """Layer ``index``: batched projections and MLP, attention request by request."""
    attn = layer.self_attn
    batch, steps = hidden.shape[0], hidden.shape[1]
    x = layer.input_layernorm(hidden)
    shape = (batch, steps, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rotary)
    outputs = [
        _attend(attn, index, q[row : row + 1], k[row : row + 1], v[row : row + 1], cache)
        for row, cache in enumerate(caches)
    ]
    attended = torch.cat(outputs).transpose(1, 2).reshape(batch, steps, -1)
    hidden = hidden + attn.o_proj(attended)
    result: torch.Tensor = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return result


def _attend(
    attn: Any, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """One request's attention at layer ``index`` over its cache, extended by ``k`` and ``v``."""
    if len(cache) > index:
        past_k, past_v = cache[index]
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        cache[index] = (k, v)
    else:
        cache.append((k, v))
    attended: torch.Tensor = F.scaled_dot_product_attention(
        q, k, v, is_causal=q.shape[2] > 1, scale=attn.scaling, enable_gqa=True
    )
    return attended
