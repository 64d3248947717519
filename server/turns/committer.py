"""Group commit: appends from many concurrent turns go to the log together.

While one append is in flight, the appends that arrive queue up and are written as one batch
when it returns: one transaction and one round trip for many turns, without a timer (an idle
server appends at once). A batch that the log refuses (a sequence conflict in one conversation,
say) is retried event group by event group, so one caller's conflict never fails another's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from core.events import NewEvent
from core.log import EventLog, RecordedEvent

_Waiting = tuple[Sequence[NewEvent], asyncio.Future[list[RecordedEvent]]]


class GroupCommitter:
    def __init__(self, log: EventLog, *, max_events: int = 512) -> None:
        self.log = log
        self.max_events = max_events
        self._waiting: deque[_Waiting] = deque()
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        self.appended = 0

    async def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        """Append ``events`` (one caller's group, atomically) and return what was stored."""
        future: asyncio.Future[list[RecordedEvent]] = asyncio.get_running_loop().create_future()
        self._waiting.append((events, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._waiting:
                batch: list[_Waiting] = []
                size = 0
                while self._waiting and (
                    not batch or size + len(self._waiting[0][0]) <= self.max_events
                ):
                    batch.append(self._waiting.popleft())
                    size += len(batch[-1][0])
                await self._write(batch)
        finally:
            self._flusher = None

    async def _write(self, batch: list[_Waiting]) -> None:
        events = [event for group, _ in batch for event in group]
        try:
            recorded = await asyncio.to_thread(self.log.append, events)
        except BaseException as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            for group, future in batch:  # find whose group the log refused
                try:
                    _settle(future, await asyncio.to_thread(self.log.append, group))
                except BaseException as single:
                    _settle(future, single)
            return
        self.batches += 1
        self.appended += len(events)
        start = 0
        for group, future in batch:
            _settle(future, recorded[start : start + len(group)])
            start += len(group)


def _settle(
    future: asyncio.Future[list[RecordedEvent]], outcome: list[RecordedEvent] | BaseException
) -> None:
    if future.done():  # the caller was cancelled; the events are stored all the same
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
