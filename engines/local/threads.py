"""Intra-op threads in a process that runs the local engine.

torch's CPU build computes in parallel with OpenMP (libgomp), which keeps one team of worker
threads per thread that has computed in parallel. Once a second thread holds a team (a
training step, or any large tensor operation, on the thread that built the engine), the
process has more OpenMP threads than cores, and libgomp cuts the time its idle workers spin
before they sleep: every parallel operation of the engine then wakes a sleeping thread. On
this 2-core machine the engine's decode steps ran about 2x slower that way (8 requests on 8
adapters, bf16: 131 tokens/s against 60, with 270,000 context switches in 30 s instead of
5,000). The scheduler building a grammar bitmask of more than about 21 rows on the building
thread made such a process; so may a Celery worker that trains, then evaluates, on one thread.

So while an engine lives, its worker thread computes on the count of threads its building
thread had, and the building thread, like every thread that first computes after it, on one
(``torch.set_num_threads`` is kept per thread; a thread that has not computed yet takes the
count set last). The building thread gets its count back when its last engine closes."""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_lent: dict[int, tuple[int, int]] = {}  # thread id -> (its count before its engines, engines)


def hand_over() -> int:
    """On the thread building an engine: the count its worker takes (this thread's, or what it
    had before its first engine still open); this thread computes on one meanwhile."""
    ident = threading.get_ident()
    with _lock:
        count, engines = _lent.get(ident, (torch.get_num_threads(), 0))
        _lent[ident] = (count, engines + 1)
    torch.set_num_threads(1)
    return count


def take_back() -> None:
    """On the thread closing an engine: its count back once its last engine is closed
    (nothing on a thread that built none)."""
    ident = threading.get_ident()
    with _lock:
        if ident not in _lent:
            return
        count, engines = _lent.pop(ident)
        if engines > 1:
            _lent[ident] = (count, engines - 1)
            return
    torch.set_num_threads(count)


def pin(count: int) -> int:
    """On the engine's worker thread, before it computes: ``count`` threads for it alone (the
    count it now has, returned)."""
    torch.get_num_threads()  # this thread takes torch's current count first ...
    torch.set_num_threads(count)  # ... then its own
    return torch.get_num_threads()
