"""What the machine's processors can run: the torch dtype a name stands for on a device, where
that device computes it natively (the served dtype, ``MACARON_DTYPE``, and a training config's
``precision`` both ask here)."""

from __future__ import annotations

from pathlib import Path

import torch

from core.errors import DtypeUnsupported

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags of native bf16 matrix instructions
CPUINFO = Path("/proc/cpuinfo")


def has_native_bf16(device: str = "cpu", cpuinfo: Path = CPUINFO) -> bool:
    """Whether ``device`` computes bfloat16 natively: a GPU that has it, or a CPU with bf16
    matrix instructions (elsewhere torch emulates it, slower than float32)."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        flags = set()
    return bool(flags & set(BF16_FLAGS))


def native_dtype(name: str, device: str = "cpu", cpuinfo: Path = CPUINFO) -> torch.dtype:
    """The torch dtype of ``name`` on ``device``: ``float32`` anywhere, ``bfloat16`` where the
    device has it natively; anything else is ``dtype_unsupported``."""
    if name == "float32":
        return torch.float32
    if name != "bfloat16":
        raise DtypeUnsupported(f"no dtype {name!r} here; one of float32, bfloat16")
    if not has_native_bf16(device, cpuinfo):
        where = "this GPU has" if device == "cuda" else "this CPU has"
        raise DtypeUnsupported(
            f"{where} no native bfloat16 ({' or '.join(BF16_FLAGS)} on a CPU): bfloat16 would "
            "run emulated, slower than float32; use float32"
        )
    return torch.bfloat16
