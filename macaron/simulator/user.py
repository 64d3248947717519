"""One simulated user: a WebSocket connection on which it asks a task per conversation, and
the oracle's feedback on each answer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal
from uuid import UUID

from pydantic import TypeAdapter, ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from core.errors import InvalidApiKey, MacaronError
from core.tasks import Task
from learners.evaluation.checkers import check
from macaron.simulator.report import PlayedTurn
from server.entrypoints import protocol as wire

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


class SimulatedUser:
    """Asks each task it takes in a fresh conversation and records how the turn went."""

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
