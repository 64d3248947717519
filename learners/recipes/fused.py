"""A LoRA layer's product in training as one autograd node: ``x W^T + s (x A^T) B^T`` with the
low-rank term added into the frozen product's output in place, and the backward pass written
out the same way.

PEFT computes the layer as four tensors an activation wide (the frozen product, ``B``'s
product, its scaling, their sum) and its backward as three more (the scaling's gradient, the
two input gradients, their sum). Each is a pass over memory; the rank-16 products themselves
are cheap. Here the frozen product's output takes the low-rank term in place (``addmm_``), and
the input gradient takes its low-rank part the same way: one activation-wide tensor each way.
The maths is PEFT's; only the rounding order differs."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from torch.autograd.function import once_differentiable


class LoraProduct(torch.autograd.Function):
    """``x @ weight.T (+ bias) + scale * (x @ a.T) @ b.T`` for a frozen ``weight`` and ``bias``
    and trainable LoRA factors ``a`` (rank x in) and ``b`` (out x rank)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise ValueError("the fused LoRA product keeps no gradient for the frozen layer")
        rows = x.reshape(-1, x.shape[-1])
        low = rows @ a.T  # (tokens, rank)
        out = nn.functional.linear(rows, weight, bias)
        out.addmm_(low, b.T.to(out.dtype), alpha=scale)
        ctx.save_for_backward(rows, low, weight, a, b)
        ctx.scale = scale
        ctx.shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, torch.Tensor, torch.Tensor, None]:
        # In the dtype the forward pass computed in (bf16 under autocast), as autocast would
        # have it; the casts are no-ops in float32.
        grad = grad.reshape(-1, grad.shape[-1])
        rows, low, weight, a, b = (t.to(grad.dtype) for t in ctx.saved_tensors)
        back = grad @ b  # the gradient to the low-rank activations, unscaled
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight).addmm_(back, a, alpha=ctx.scale).view(ctx.shape)
        grad_a = (back.T @ rows).float().mul_(ctx.scale)
        grad_b = (grad.T @ low).float().mul_(ctx.scale)
        return grad_x, None, None, grad_a.to(a.dtype), grad_b.to(b.dtype), None


def fusable(layer: nn.Module) -> bool:
    """Whether ``layer`` is a plain LoRA linear layer the fused product computes exactly: one
    adapter, no dropout, no variant (DoRA and the like), no LoRA bias, an unmerged, frozen
    ``nn.Linear`` base stored as (out, in). Asked again at every call: an adapter merged or
    switched later runs PEFT's path."""
    if not isinstance(layer, LoraLinear) or len(layer.active_adapters) != 1:
        return False
    name = layer.active_adapters[0]
    base = layer.get_base_layer()
    return (
        name in layer.lora_A
        and isinstance(layer.lora_dropout[name], nn.Identity)
        and name not in getattr(layer, "lora_variant", {})
        and not layer.use_dora.get(name, False)
        and layer.lora_B[name].bias is None
        and not layer.fan_in_fan_out
        and not layer.merged
        and isinstance(base, nn.Linear)
        and not base.weight.requires_grad
        and (base.bias is None or not base.bias.requires_grad)
    )


def _forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if layer.disable_adapters or args or kwargs or not fusable(layer):  # merged, switched...
        result: torch.Tensor = type(layer).forward(layer, x, *args, **kwargs)
        return result
    name = layer.active_adapters[0]
    base = layer.get_base_layer()
    out: torch.Tensor = LoraProduct.apply(  # type: ignore[no-untyped-call]
        x,
        base.weight,
        base.bias,
        layer.lora_A[name].weight,
        layer.lora_B[name].weight,
        layer.scaling[name],
    )
    return out


def fuse_lora_layers(model: nn.Module) -> int:
    """Give every ``fusable`` LoRA layer of ``model`` the fused product as its forward pass;
    how many it fused. Others keep PEFT's. The modules and their state stay PEFT's, so the
    adapter saves as before."""
    fused = 0
    for layer in model.modules():
        if fusable(layer):
            layer.forward = partial(_forward, layer)
            fused += 1
    return fused
