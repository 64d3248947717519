"""The local engine's intra-op threads (``engines.local.threads``): its worker computes on the count
of threads the thread that built it had, that thread on one while any engine it built is open
(a second OpenMP team beside the engine's slows both), and it gets its count back when its
last engine closes; a thread that never built an engine is left alone by ``take_back``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from engines.local import threads
from engines.local.engine import LocalEngine


def worker_threads(engine: LocalEngine) -> int:
    deadline = time.monotonic() + 30
    while engine.stats["threads"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats["threads"]


def test_an_engine_borrows_its_builders_threads_and_gives_them_back(
    tiny_model: Path, two_torch_threads: None
) -> None:
    first = LocalEngine(tiny_model)
    try:
        assert torch.get_num_threads() == 1
        assert worker_threads(first) == 2
        second = LocalEngine(tiny_model)  # the count lent, not this thread's one
        assert worker_threads(second) == 2
        second.close()
        assert torch.get_num_threads() == 1  # the first engine is still open
    finally:
        first.close()
    assert torch.get_num_threads() == 2


def test_take_back_leaves_a_thread_that_built_no_engine_alone(two_torch_threads: None) -> None:
    seen: list[int] = []

    def elsewhere() -> None:
        torch.set_num_threads(2)
        threads.take_back()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [2]
