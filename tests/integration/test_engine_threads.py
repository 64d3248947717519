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


def test_an_engine_borrows_its_builders_threads_and_gives_them_back(tiny_model: Path) -> None:
    seen: list[tuple[str, int]] = []

    def build() -> None:  # on a thread of its own: no engine another test built is open on it
        torch.set_num_threads(2)
        first = LocalEngine(tiny_model)
        try:
            seen.append(("builder, first open", torch.get_num_threads()))
            seen.append(("first's worker", worker_threads(first)))
            second = LocalEngine(tiny_model)  # the count lent, not this thread's one
            seen.append(("second's worker", worker_threads(second)))
            second.close()
            seen.append(("builder, first still open", torch.get_num_threads()))
        finally:
            first.close()
        seen.append(("builder, all closed", torch.get_num_threads()))

    builder = threading.Thread(target=build)
    builder.start()
    builder.join()
    assert seen == [
        ("builder, first open", 1),
        ("first's worker", 2),
        ("second's worker", 2),
        ("builder, first still open", 1),
        ("builder, all closed", 2),
    ]


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
