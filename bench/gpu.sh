#!/usr/bin/env bash
# The GPU check in one script (bench/gpu.py says what it measures). Three ways to run it:
#
#   bash bench/gpu.sh --prepare   here, once: puts SmolLM2's tokenizer and the wheels of the
#                                 project's pure-Python needs the GPU machine lacks (at this
#                                 checkout's versions) into .gpu/, which git ignores, so they
#                                 can travel with the working tree
#   bash bench/gpu.sh             on the GPU machine, .gpu/ carried: installs the wheels into
#                                 /tmp/site, runs every part, writes bench/results/gpu.json
#                                 after each part (and copies it to $OUT, when that is set,
#                                 whatever happens); under 10 minutes
#   bash bench/gpu.sh --dry-run   anywhere, in seconds: every part on the CPU, a tiny shape;
#                                 rows kept in $GPU_RESULTS if set (a test runs this in CI)
#
# PYTHON names the interpreter (default: .venv/bin/python here, python3 on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
mode=${1:-}
home=${MACARON_HOME:-$HOME/.local/state/macaron}

# Imported by the engine and the recipe, and absent from the GPU machine's image (its torch,
# transformers, peft, safetensors, numpy, pyyaml, rich and typer are used as they are there).
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
        pydantic-settings python-dotenv xgrammar apache-tvm-ffi
        opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions)

case "$mode" in
  --prepare)
    python=${PYTHON:-.venv/bin/python}
    model="$home/models/smollm2-135m-instruct"
    if [ ! -f "$model/tokenizer.json" ] || [ ! -f "$model/chat_template.jinja" ]; then
      echo "no pulled SmolLM2 (tokenizer and chat template) at $model: run macaron model pull" >&2
      exit 1
    fi
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    rm -rf .gpu && mkdir -p .gpu/tokenizer .gpu/wheels
    cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/chat_template.jinja \
      .gpu/tokenizer/
    pinned=$("$python" -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${WHEELS[@]}")
    # shellcheck disable=SC2086  # one requirement per word
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .gpu/wheels $pinned
    du -sh .gpu
    echo "ready: run 'bash bench/gpu.sh' on the GPU machine with .gpu carried"
    ;;
  --dry-run)
    python=${PYTHON:-.venv/bin/python}
    # GPU_TOKENIZER: a folder with SmolLM2's tokenizer; GPU_RESULTS: where to keep the rows
    tokenizer=${GPU_TOKENIZER:-$home/models/smollm2-135m-instruct}
    if [ -n "${GPU_RESULTS:-}" ]; then
      results=$GPU_RESULTS
    else
      results=$(mktemp -d)
      trap 'rm -rf "$results"' EXIT
    fi
    "$python" -m bench.gpu --dry-run --tokenizer "$tokenizer" --results "$results"
    ;;
  "")
    python=${PYTHON:-python3}
    [ -d .gpu/tokenizer ] || { echo "no .gpu/: run 'bash bench/gpu.sh --prepare' here first, then carry .gpu" >&2; exit 1; }
    if [ -n "${OUT:-}" ]; then
      trap 'cp bench/results/gpu.json "$OUT/" 2>/dev/null || true' EXIT
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .gpu/wheels/*.whl
    export PYTHONPATH=/tmp/site
    "$python" -m bench.gpu --tokenizer .gpu/tokenizer
    ;;
  *)
    echo "usage: bash bench/gpu.sh [--prepare | --dry-run]" >&2
    exit 2
    ;;
esac
