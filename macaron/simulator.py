"""The user simulator: simulated users play task-bank prompts against a running chat server over
WebSocket protocol v1, and an oracle gives the feedback a careful user would.

Each user holds one connection and asks one task per conversation (a ``hello`` starts a fresh
one), with the task's specialist as the hint. The answer is what a client shows: the model's
first tool call when an ``action`` frame arrived, else the GenUI tree as compact JSON, else the
streamed text. The oracle checks it with the task's checker: ``up`` when it passes, otherwise an
``edit`` whose text is the task's reference, so wrong answers become training data with the
correct target. ``rate_limited`` errors wait and retry; any other error frame ends that turn and
is counted, never ending the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from uuid import UUID

from pydantic import TypeAdapter, ValidationError
from rich.table import Table
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from core.contract import Task
from core.errors import ConfigError, InvalidApiKey, MacaronError
from learners.contract import check
from server import protocol as wire

DEFAULT_SPECIALISTS = ("genui", "agent")
SIMULATOR_TENANT = "simulator"
"""The tenant whose key simulated users use when none is given."""
TURN_TIMEOUT_S = 600.0
"""Longest wait for the next frame of a turn before the turn counts as an error."""
OPEN_TIMEOUT_S = 30.0
FIRST_RETRY_S = 1.0
LONGEST_RETRY_S = 8.0
RATE_LIMIT_PATIENCE_S = 180.0
"""How long one turn keeps retrying after ``rate_limited`` before it counts as an error."""
CLOSE_UNAUTHENTICATED = 4401

_SERVER_FRAME: TypeAdapter[wire.ServerFrame] = TypeAdapter(wire.ServerFrame)


class SimulationFailed(MacaronError):
    """The server cannot be reached or talked to at all: every turn would fail the same way."""

    code = "simulation_failed"


# --- what was played --------------------------------------------------------------------------


@dataclass(frozen=True)
class PlayedTurn:
    """One task asked once. ``error`` is the code of the error frame that ended the turn (or
    its feedback); ``rate_limited`` counts the times it was told to wait first."""

    index: int
    task_id: str
    specialist: str
    turn_id: UUID | None = None
    answer: str | None = None
    passed: bool = False
    feedback: Literal["up", "edit"] | None = None
    latency_ms: float | None = None
    error: str | None = None
    rate_limited: int = 0


@dataclass
class SpecialistStats:
    """Turns of one specialist: ``answered`` completed, ``passed`` of those were right."""

    turns: int = 0
    answered: int = 0
    passed: int = 0
    ups: int = 0
    edits: int = 0
    errors: int = 0
    latency_ms_total: float = 0.0

    def add(self, turn: PlayedTurn) -> None:
        self.turns += 1
        self.errors += turn.error is not None
        self.ups += turn.feedback == "up"
        self.edits += turn.feedback == "edit"
        if turn.latency_ms is not None and turn.answer is not None:
            self.answered += 1
            self.passed += turn.passed
            self.latency_ms_total += turn.latency_ms

    @property
    def pass_rate(self) -> float:
        return self.passed / self.answered if self.answered else 0.0

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_ms_total / self.answered if self.answered else 0.0


@dataclass(frozen=True)
class SimulationReport:
    turns: list[PlayedTurn]
    seconds: float

    def by_specialist(self) -> dict[str, SpecialistStats]:
        stats: dict[str, SpecialistStats] = {}
        for turn in self.turns:
            stats.setdefault(turn.specialist, SpecialistStats()).add(turn)
        return dict(sorted(stats.items()))

    def total(self) -> SpecialistStats:
        stats = SpecialistStats()
        for turn in self.turns:
            stats.add(turn)
        return stats

    @property
    def rate_limited(self) -> int:
        return sum(turn.rate_limited for turn in self.turns)


def report_table(report: SimulationReport, title: str = "simulated users") -> Table:
    table = Table(
        title=title,
        caption=f"{len(report.turns)} turns in {report.seconds:.1f} s; "
        f"told to wait {report.rate_limited} times (rate_limited)",
    )
    for column in ("specialist", "turns", "pass rate", "ups", "edits", "errors", "mean latency"):
        table.add_column(column, justify="left" if column == "specialist" else "right")
    rows = list(report.by_specialist().items())
    if len(rows) > 1:
        rows.append(("all", report.total()))
    for name, s in rows:
        table.add_row(
            name,
            str(s.turns),
            f"{s.pass_rate:.1%}",
            str(s.ups),
            str(s.edits),
            str(s.errors),
            f"{s.mean_latency_ms:.0f} ms",
        )
    return table


# --- which tasks ------------------------------------------------------------------------------


def bank_tasks(bank: Iterable[Task], specialists: Sequence[str]) -> list[Task]:
    """The bank's tasks of ``specialists``; ``ConfigError`` when a name has none."""
    tasks = [task for task in bank if task.specialist in specialists]
    empty = sorted(set(specialists) - {task.specialist for task in tasks})
    if empty:
        known = sorted({task.specialist for task in bank})
        raise ConfigError(
            f"the task bank has no tasks for {', '.join(empty)}; it has: {', '.join(known)}"
        )
    return tasks


def task_stream(tasks: Sequence[Task], seed: int) -> Iterator[Task]:
    """Endless seeded play order: every task once in a shuffled round, then a new round."""
    if not tasks:
        raise ConfigError("no tasks to play")
    rng = random.Random(seed)  # noqa: S311 (play order, not secrets)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def pick_tasks(tasks: Sequence[Task], turns: int, seed: int) -> list[Task]:
    """The first ``turns`` tasks of ``task_stream``."""
    stream = task_stream(tasks, seed)
    return [next(stream) for _ in range(turns)]


# --- playing ----------------------------------------------------------------------------------


async def run_simulation(
    url: str,
    key: str,
    plan: Sequence[Task],
    *,
    concurrency: int,
    on_turn: Callable[[PlayedTurn], None] | None = None,
) -> SimulationReport:
    """Play every task of ``plan`` once, with at most ``concurrency`` users at a time."""
    if concurrency < 1:
        raise ConfigError("concurrency must be at least 1")
    queue: asyncio.Queue[tuple[int, Task]] = asyncio.Queue()
    for index, task in enumerate(plan):
        queue.put_nowait((index, task))
    played: list[PlayedTurn] = []

    def record(turn: PlayedTurn) -> None:
        played.append(turn)
        if on_turn is not None:
            on_turn(turn)

    started = time.monotonic()
    try:
        async with asyncio.TaskGroup() as users:
            for _ in range(min(concurrency, len(plan))):
                users.create_task(_SimulatedUser(url, key, record).play(queue))
    except* MacaronError as failed:
        raise failed.exceptions[0] from None
    return SimulationReport(sorted(played, key=lambda t: t.index), time.monotonic() - started)


class _TurnEnded(Exception):
    """An error frame (or a lost connection) ended the turn."""

    def __init__(self, code: str, *, reconnect: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.reconnect = reconnect


@dataclass
class _Answer:
    turn_id: UUID | None = None
    text: list[str] = field(default_factory=list)
    tree: dict[str, object] | None = None
    call: dict[str, object] | None = None

    def shown(self) -> str:
        """What the oracle judges: the first tool call, else the tree, else the text."""
        if self.call is not None:
            return json.dumps(self.call, separators=(",", ":"))
        if self.tree is not None:
            return json.dumps(self.tree, separators=(",", ":"))
        return "".join(self.text)


class _SimulatedUser:
    def __init__(self, url: str, key: str, record: Callable[[PlayedTurn], None]) -> None:
        self.url = url
        self.key = key
        self.record = record
        self.ws: ClientConnection | None = None
        self.waits = 0
        """Times the current turn was told to wait (``rate_limited``)."""

    async def play(self, queue: asyncio.Queue[tuple[int, Task]]) -> None:
        try:
            while not queue.empty():
                index, task = queue.get_nowait()
                self.record(await self._turn(index, task))
        finally:
            await self._drop()

    async def _turn(self, index: int, task: Task) -> PlayedTurn:
        self.waits = 0
        try:
            await self._fresh_conversation()
            answer, turn_id, latency_ms = await self._ask_patiently(index, task)
        except _TurnEnded as ended:
            await self._after(ended)
            return PlayedTurn(
                index, task.id, task.specialist, error=ended.code, rate_limited=self.waits
            )
        passed = await asyncio.to_thread(check, task, answer)
        turn = PlayedTurn(
            index,
            task.id,
            task.specialist,
            turn_id,
            answer,
            passed,
            latency_ms=latency_ms,
            rate_limited=self.waits,
        )
        feedback: Literal["up", "edit"] = "up" if passed else "edit"
        try:
            await self._feedback(turn_id, feedback, task)
        except _TurnEnded as ended:
            await self._after(ended)
            return replace(turn, error=ended.code)
        return replace(turn, feedback=feedback)

    async def _after(self, ended: _TurnEnded) -> None:
        if ended.reconnect:
            await self._drop()

    async def _ask_patiently(self, index: int, task: Task) -> tuple[str, UUID, float]:
        """Ask until answered, waiting after each ``rate_limited`` (doubling, up to a limit);
        returns the answer as shown, its turn id and the latency of the answered attempt."""
        delay, patience = FIRST_RETRY_S, time.monotonic() + RATE_LIMIT_PATIENCE_S
        while True:
            started = time.monotonic()
            try:
                answer = await self._ask(index, task)
            except _TurnEnded as ended:
                if ended.code != "rate_limited" or time.monotonic() + delay > patience:
                    raise
            else:
                if answer.turn_id is None:
                    raise SimulationFailed("the server completed a turn it never started")
                return answer.shown(), answer.turn_id, (time.monotonic() - started) * 1000
            self.waits += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, LONGEST_RETRY_S)

    async def _connection(self) -> ClientConnection:
        if self.ws is not None:
            return self.ws
        try:
            ws = await connect(
                self.url,
                additional_headers={"Authorization": f"Bearer {self.key}"},
                open_timeout=OPEN_TIMEOUT_S,
                max_size=None,
            )
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            raise SimulationFailed(f"cannot open a WebSocket to {self.url}: {exc}") from exc
        self.ws = ws
        frame = await self._next(ws)
        if isinstance(frame, wire.Error):
            await self._drop()
            raise _TurnEnded(frame.code)
        return ws

    async def _drop(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            await ws.close()

    async def _fresh_conversation(self) -> None:
        """A ``hello`` without a conversation makes the next turn start a new one."""
        if self.ws is None:
            await self._connection()  # a new connection has no conversation yet
            return
        await self._send(wire.Hello(type="hello"))
        await self._until(wire.Ready)

    async def _ask(self, index: int, task: Task) -> _Answer:
        ws = await self._connection()
        await self._send(
            wire.UserTurn(
                type="user_turn",
                client_msg_id=f"sim-{index}",
                content=task.prompt,
                specialist_hint=task.specialist,
            )
        )
        answer = _Answer()
        while True:
            frame = await self._next(ws)
            match frame:
                case wire.TurnStarted():
                    answer.turn_id = frame.turn_id
                case wire.Token():
                    answer.text.append(frame.delta)
                case wire.GenUI():
                    answer.tree = dict(frame.tree)
                case wire.Action() if answer.call is None:
                    answer.call = {"tool": frame.name, "args": dict(frame.args)}
                case wire.Error():
                    raise _TurnEnded(frame.code)
                case wire.TurnCompleted():
                    return answer

    async def _feedback(self, turn_id: UUID, kind: Literal["up", "edit"], task: Task) -> None:
        """Send the oracle's verdict; the ``pong`` after it says it was recorded (frames of one
        connection are handled in order, so an error would come first)."""
        edited = task.reference if kind == "edit" else None
        await self._send(
            wire.Feedback(type="feedback", turn_id=turn_id, kind=kind, edited_text=edited)
        )
        await self._send(wire.Ping(type="ping"))
        await self._until(wire.Pong)

    async def _send(self, frame: wire.Frame) -> None:
        ws = await self._connection()
        try:
            await ws.send(frame.model_dump_json(exclude_none=True))
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    async def _until(self, kind: type[wire.Frame]) -> None:
        ws = await self._connection()
        while True:
            frame = await self._next(ws)
            if isinstance(frame, wire.Error):
                raise _TurnEnded(frame.code)
            if isinstance(frame, kind):
                return

    async def _next(self, ws: ClientConnection) -> wire.ServerFrame:
        try:
            raw = await asyncio.wait_for(ws.recv(), TURN_TIMEOUT_S)
        except TimeoutError:
            raise _TurnEnded("timeout", reconnect=True) from None
        except ConnectionClosed as exc:
            raise self._closed(exc) from None
        return _decode(raw)

    def _closed(self, exc: ConnectionClosed) -> Exception:
        self.ws = None
        if exc.rcvd is not None and exc.rcvd.code == CLOSE_UNAUTHENTICATED:
            return InvalidApiKey(f"the server refused the key: {exc.rcvd.reason}")
        return _TurnEnded("connection_closed")


def _decode(raw: str | bytes) -> wire.ServerFrame:
    """A server frame as its model. A ``ready`` frame leaves out ``conversation_id`` when there
    is none (``conversation_id?`` in docs/protocol.md), which its model spells ``None``."""
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and data.get("type") == "ready":
            data.setdefault("conversation_id", None)
        return _SERVER_FRAME.validate_python(data)
    except (ValueError, ValidationError) as exc:
        raise SimulationFailed(f"the server sent a frame outside protocol v1: {exc}") from exc
