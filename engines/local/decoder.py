"""The local engine's forward pass over a Hugging Face decoder of the Llama, Qwen2 (biased QKV)
or Mistral family (a sliding attention window where the config names one): linear layers run
batched across requests (``MultiLoRALinear`` applies each row's adapter), and keys and values
live in the batch's ``KVPool``, a slot per request. A decode pass (one token a row) attends
for all rows in one call per layer, each row masked to its own slot's tokens; a pass of prompt
chunks attends request by request over its own slot. Either way no padding enters the maths
and each request computes what it would compute alone. Rows may carry different numbers of
tokens (prompt chunks of several requests in one pass): the shorter are padded, and the
padding is sliced off before each attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engines.local.kv_pool import KVSlot

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for every position of the pass


@dataclass(frozen=True)
class Pass:
    """What every layer of one pass shares: each row's slot and how many tokens it carries,
    and the rotary embedding of every position."""

    slots: list[KVSlot]
    lengths: list[int]
    rotary: Rotary


def forward(model: Any, slots: list[KVSlot], tokens: list[list[int]]) -> torch.Tensor:
    """One pass: ``tokens`` per request (a prompt's chunk, or one answer token), continuing
    and extending each request's slot in place. Rows shorter than the longest are padded;
    padding never enters a slot or an attention. Returns each row's last token's logits, in
    float32 on the CPU."""
    inner = model.model
    lengths = [len(t) for t in tokens]
    steps = max(lengths)
    slots[0].pool.reserve(max(s.length + n for s, n in zip(slots, lengths, strict=True)))
    device = inner.embed_tokens.weight.device
    ids = torch.tensor([t + [0] * (steps - len(t)) for t in tokens], device=device)
    positions = torch.tensor(
        [list(range(s.length, s.length + steps)) for s in slots], device=device
    )
    hidden = inner.embed_tokens(ids)
    step = Pass(slots, lengths, inner.rotary_emb(hidden, positions))
    for index, layer in enumerate(inner.layers):
        window = attention_window(model.config, layer.self_attn)
        hidden = _decoder_layer(layer, index, hidden, step, window)
    for slot, length in zip(slots, lengths, strict=True):
        slot.advance(length)
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
    layer: Any, index: int, hidden: torch.Tensor, step: Pass, window: int | None
) -> torch.Tensor:
    """Layer ``index``: batched projections and MLP; attention over each row's own tokens, in
    one call for a decode pass, else request by request."""
    attn = layer.self_attn
    batch, steps = hidden.shape[0], hidden.shape[1]
    x = layer.input_layernorm(hidden)
    shape = (batch, steps, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *step.rotary)
    if steps == 1:
        pool = step.slots[0].pool
        merged = pool.decode_attention(
            index, step.slots, q, (k, v), scale=attn.scaling, window=window
        )
    else:
        merged = _prefill_attention(attn, index, step.slots, step.lengths, (q, k, v), window)
    hidden = hidden + attn.o_proj(merged.transpose(1, 2).reshape(batch, steps, -1))
    result: torch.Tensor = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return result


def _prefill_attention(
    attn: Any,
    index: int,
    slots: list[KVSlot],
    lengths: list[int],
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    window: int | None,
) -> torch.Tensor:
    """Attention request by request, each row's ``lengths`` tokens over its own slot."""
    q, k, v = qkv
    attended = q.new_zeros(q.shape)
    for row, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
        start = slot.length
        keys, values = slot.extend(index, k[row : row + 1, :, :n], v[row : row + 1, :, :n])
        out = _attend(attn, q[row : row + 1, :, :n], keys, values, start, window)
        attended[row, :, :n] = out[0]
    return attended


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
