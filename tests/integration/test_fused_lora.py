"""The training recipe's fused LoRA product (``learners/recipes/fused.py``) against PEFT's own
layers, on the tiny model: the same outputs and the same gradients, to the rounding of their
dtype (``tests/numeric.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from infra.identity_adapter import write_identity_adapter
from learners.recipes.fused import LoraProduct, fuse_lora_layers
from learners.recipes.lora import compute_in, load_model
from tests.numeric import assert_close, eps, relative_error

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def parent(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("parent")
    write_identity_adapter(tiny_model, folder, base_model="tiny", rank=4, seed=3)
    return folder


# In float32, relative norm, on the default, AVX2 and AVX-512 kernels and on one thread:
LOGITS_ULPS = 64  # the fused product's logits against PEFT's: 0 seen, the same sums
GRADIENT_ULPS = 64  # a LoRA weight's gradient, summed in another order: 8 at most seen
MERGED_ULPS = 128  # a merged weight is rounded once more: 30-40 seen


def _peft_model(tiny_model: Path, adapter: Path, dtype: torch.dtype) -> Any:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype)
    return PeftModel.from_pretrained(base, adapter, is_trainable=True, autocast_adapter_dtype=True)


def _loss_and_grads(
    model: Any, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B away from 0 (an identity adapter's), the same in both models
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=generator)
    with compute_in("cpu", dtype):
        logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    return logits.detach(), grads


def _fused_layers(model: Any) -> int:
    return sum(1 for layer in model.modules() if "forward" in vars(layer))


def test_the_fused_product_has_peft_s_outputs_and_gradients(tiny_model: Path, parent: Path) -> None:
    """Every LoRA layer of the training model runs the fused product, and the logits and the
    gradients of every LoRA weight are PEFT's, to float32's rounding (the gradients sum in
    another order). Guards the fused maths: a scaling applied twice or left out, a transposed
    factor, or the low-rank part of the input gradient dropped moves these by percents."""
    fused, _ = load_model(tiny_model, parent)
    layers = sum(1 for name, _ in fused.named_modules() if name.endswith("_proj"))
    assert fuse_lora_layers(_peft_model(tiny_model, parent, torch.float32)) == layers > 0
    assert _fused_layers(fused) == layers  # the training model runs the fused product

    mine, my_grads = _loss_and_grads(fused)
    theirs, their_grads = _loss_and_grads(_peft_model(tiny_model, parent, torch.float32))
    assert_close(mine, theirs, ulps=LOGITS_ULPS)
    assert len(my_grads) == len(their_grads) == 2 * layers
    for a, b in zip(my_grads, their_grads, strict=True):
        assert b.abs().sum() > 0
        assert_close(a, b, ulps=GRADIENT_ULPS)


def test_in_bf16_the_fused_product_is_as_close_to_float32_as_peft_s(
    tiny_model: Path, parent: Path
) -> None:
    """Under bf16 autocast (as a bf16 run computes) both round, in a different order: the
    fused product's logits and gradients are no further from float32's than PEFT's are. (A CPU
    without bf16 instructions emulates them: slower, rounded the same.) Guards the casts of the
    backward pass: a gradient left in bf16, or the product computed in float32 beside a bf16
    base, lands farther from float32 than PEFT does."""
    exact, exact_grads = _loss_and_grads(_peft_model(tiny_model, parent, torch.float32))
    bf16 = torch.bfloat16
    fused = load_model(tiny_model, parent, dtype=bf16)[0]
    assert _fused_layers(fused) > 0
    mine, my_grads = _loss_and_grads(fused, bf16)
    theirs, their_grads = _loss_and_grads(_peft_model(tiny_model, parent, bf16), bf16)
    assert relative_error(theirs, exact) > 1e-3  # bf16 rounds
    assert relative_error(mine, exact) <= 1.1 * relative_error(theirs, exact)
    mine_off = [relative_error(a, b) for a, b in zip(my_grads, exact_grads, strict=True)]
    theirs_off = [relative_error(a, b) for a, b in zip(their_grads, exact_grads, strict=True)]
    assert all(a.dtype == torch.float32 for a in my_grads)
    assert sum(mine_off) <= 1.1 * sum(theirs_off)
    assert max(mine_off) <= 1.1 * max(theirs_off)


def test_layers_it_cannot_compute_exactly_keep_peft_s_forward(
    tiny_model: Path, parent: Path, tmp_path: Path
) -> None:
    """An adapter with dropout is not fused (the product leaves dropout out): PEFT runs it."""
    adapter = tmp_path / "dropout"
    adapter.mkdir()
    for file in parent.iterdir():
        (adapter / file.name).write_bytes(file.read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"lora_dropout": 0.1}))
    assert fuse_lora_layers(_peft_model(tiny_model, adapter, torch.float32)) == 0


def test_a_layer_merged_after_fusing_runs_peft_s_path(tiny_model: Path, parent: Path) -> None:
    """The fused forward asks again at every call: merged into the base, the adapter is not
    added a second time. Merging rounds each weight once more, so the logits part by float32's
    rounding; a second adding would move them by the adapter's whole effect, which is checked
    to be far outside the bound."""
    model, _ = load_model(tiny_model, parent)
    ids = torch.arange(12)[None]
    _loss_and_grads(model)  # B away from 0
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
        before = model(input_ids=ids).logits
        model.base_model.merge_adapter()
        merged = model(input_ids=ids).logits
    assert_close(merged, before, ulps=MERGED_ULPS)
    assert relative_error(before, plain) > 100 * MERGED_ULPS * eps(torch.float32)


def test_the_product_keeps_no_gradient_for_the_frozen_layer() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    a, b = torch.randn(2, 8, requires_grad=True), torch.randn(5, 2, requires_grad=True)
    with pytest.raises(ValueError):
        LoraProduct.apply(  # type: ignore[no-untyped-call]
            x, torch.randn(5, 8, requires_grad=True), None, a, b, 2.0
        )
