"""Compute ops: multi-LoRA shrink/expand for mixed-adapter batches (a torch reference, a fast
CPU path, Triton kernels)."""
