"""The sandbox coding answers are tested in: untrusted code runs in a subprocess with no
network, no environment, an empty working folder and resource limits, and is not run at all
where the network cannot be taken away."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PYTHON_TIMEOUT_S = 10.0
PYTHON_MEMORY_BYTES = 512 * 2**20
PYTHON_FILE_BYTES = 16 * 2**20
"""Largest file the tested code may write, its output included."""

_log = logging.getLogger(__name__)

_PYTHON_FENCE = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def code_of(output: str) -> str:
    """The first fenced ```python block of an answer, or the whole answer when it has none."""
    fenced = _PYTHON_FENCE.search(output)
    return fenced.group(1) if fenced else output


@functools.cache
def _network_jail() -> tuple[str, ...] | None:
    """The command prefix that runs a program in a new, empty network namespace, if it works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = (unshare, "--net", "--map-root-user")
    try:
        trial = subprocess.run([*prefix, "/bin/true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if trial.returncode == 0 else None


def python_tests_pass(code: str, tests: str, *, timeout_s: float = PYTHON_TIMEOUT_S) -> bool:
    """Run ``code`` then ``tests`` as one program in the sandbox; ``True`` when the tests finish.

    The program ends by printing a random token, so code that exits early (``sys.exit(0)``)
    fails. A timeout, a crash, a resource limit or a failed assertion is ``False``; so is every
    run where ``unshare`` cannot remove the network, because untrusted code never runs with one.
    """
    jail = _network_jail()
    if jail is None:
        _log.warning("python_tests checker refused to run: 'unshare --net' is not available")
        return False
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="macaron-check-") as scratch:
        workdir, stdout = Path(scratch, "run"), Path(scratch, "stdout")
        workdir.mkdir()
        program = workdir / "program.py"
        program.write_text(f"{code}\n\n{tests}\n\nprint({token!r})\n", encoding="utf-8")
        command = [*jail, sys.executable, "-I", "-S", program.name]
        with stdout.open("wb") as out:
            exited_cleanly = _exits_cleanly(command, workdir, out, timeout_s)
        return exited_cleanly and stdout.read_bytes().endswith(f"{token}\n".encode())


def _exits_cleanly(
    command: Sequence[str], workdir: Path, stdout: IO[bytes], timeout_s: float
) -> bool:
    process = subprocess.Popen(
        command,
        cwd=workdir,
        env={"PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        preexec_fn=functools.partial(_limit_resources, cpu_s=int(timeout_s) + 1),
        start_new_session=True,
    )
    try:
        return process.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        _kill_group(process)


def _limit_resources(cpu_s: int) -> None:
    """Runs in the child before ``exec``: the limits hold for the tested code and its children."""
    resource.setrlimit(resource.RLIMIT_AS, (PYTHON_MEMORY_BYTES, PYTHON_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (PYTHON_FILE_BYTES, PYTHON_FILE_BYTES))


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """End the tested program and anything it started (its own session and process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
