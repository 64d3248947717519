"""What the Celery worker does with the memory a task freed: it gives it back to the system."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FREED_THEN_TASK_ENDS = """
from celery.signals import task_postrun
import learners.worker  # connects the worker's signal handlers

def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024

before = rss_mb()
blocks = [bytes(4096) for _ in range(100_000)]  # 400 MB in blocks small enough for the heap
kept = bytes(4096)  # allocated above them: the heap cannot shrink from its top
del blocks
freed = rss_mb()
task_postrun.send(sender=None)
print(before, freed, rss_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_a_finished_task_gives_the_memory_it_freed_back() -> None:
    """glibc keeps a task's freed blocks for reuse; once the task ends the worker returns
    them, so the next task does not start from the last one's peak."""
    done = subprocess.run(
        [sys.executable, "-c", FREED_THEN_TASK_ENDS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    before, freed, trimmed = map(float, done.stdout.split())
    assert freed > before + 300  # glibc kept the freed blocks
    assert trimmed < before + 100
