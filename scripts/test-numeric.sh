#!/usr/bin/env bash
# The numeric tests (pytest -m numeric: tolerances, kernels, greedy equality) once more on each
# kernel path the CPU has, so that a tolerance which holds on one path only fails here and not
# on a user's machine: under each ATen CPU capability (default, avx2, avx512) the CPU runs,
# other than its own, which the whole suite has just run under, and on one thread. vLLM's
# replicas are left out: they compute with their own compiled kernels, and each run would
# spend a minute starting them. Run after scripts/test.sh (it uses the .venv that made).
set -euo pipefail
cd "$(dirname "$0")/.."

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() {  # whether the CPU has every flag named
    local flag
    for flag in "$@"; do
        [[ "$flags" == *" $flag "* ]] || return 1
    done
}
# ATen takes a capability the CPU lacks and then dies of an illegal instruction: ask the flags.
capabilities=(default)
has avx2 fma && capabilities+=(avx2)
has avx512f avx512bw avx512vl avx512dq && capabilities+=(avx512)
own=$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')

run() {  # run NAME [VAR=VALUE ...]: the numeric tests with those variables set
    local name=$1
    shift
    echo "== numeric tests, $name"
    set +e
    env "$@" .venv/bin/python -m pytest -q -m "numeric and not vllm" -p no:cacheprovider \
        -n "${MACARON_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -o addopts="-ra --strict-markers"
    local status=$?
    set -e
    if [ "$status" -ne 0 ]; then
        echo "error: the numeric tests failed ($name)" >&2
        exit "$status"
    fi
}

for capability in "${capabilities[@]}"; do
    if [ "$capability" = "$own" ]; then
        echo "== numeric tests, ATEN_CPU_CAPABILITY=$capability: the CPU's own, run by the suite"
        continue
    fi
    run "ATEN_CPU_CAPABILITY=$capability" "ATEN_CPU_CAPABILITY=$capability"
done
run "one thread (OMP_NUM_THREADS=1)" OMP_NUM_THREADS=1
