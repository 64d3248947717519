"""Run by test_lora_kernels.py with TRITON_INTERPRET=1: the Triton kernels against the
reference on a few shapes (the interpreter is slow), both dtypes and -1 rows."""

from __future__ import annotations

import os

import torch

from kernels.lora_triton import expand_triton, shrink_triton
from tests.unit.test_lora_kernels import Case, close, expected

assert os.environ.get("TRITON_INTERPRET") == "1"
for case in (
    Case(9, 40, 24, (4, 8, 5), "random", 0.3, torch.float32, 0),
    Case(6, 70, 130, (16, 64), "sorted", 0.0, torch.float32, 1),
    Case(5, 64, 64, (8,), "one-adapter", 0.4, torch.bfloat16, 2),
    Case(3, 33, 17, (4, 32, 16, 8), "random", 1.0, torch.float32, 3),
):
    x, y, stack, idx = case.build()
    h = shrink_triton(x, stack.a, idx)
    close(expand_triton(y, h, stack.b, stack.scale, idx), expected(x, y, stack, idx), case.dtype)
print("triton kernels match")
