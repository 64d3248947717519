"""The WebSocket endpoint ``/v1/ws``: protocol v1 as an explicit state machine per connection.

States: ``AWAITING_HELLO`` (no key on the upgrade: the first frame must be ``hello`` with one),
``READY``, ``CLOSED``. A turn runs as its own task so ``cancel`` and ``ping`` are answered while
it streams; a turn whose client went away still runs to its durable end, so the client can
resend its ``client_msg_id`` after reconnecting and get the recorded answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from uuid import UUID

from opentelemetry.trace import StatusCode
from starlette.websockets import WebSocket, WebSocketDisconnect

from core.auth import Principal, bearer_key
from core.errors import InvalidApiKey, InvalidFrame, MacaronError, TooManyConnections, TurnNotFound
from infra import observe
from server.chat import ChatService
from server.entrypoints import protocol as wire
from server.entrypoints.gate import Gate
from server.turns import items
from server.turns.feedback import regeneration
from server.turns.request import TurnRequest

CLOSE_UNAUTHENTICATED = 4401
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013
HELLO_TIMEOUT_S = 10.0
MAX_INVALID_FRAMES = 20


class State(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    READY = "ready"
    CLOSED = "closed"


class ChatConnection:
    def __init__(self, websocket: WebSocket, service: ChatService, gate: Gate) -> None:
        self.ws = websocket
        self.service = service
        self.gate = gate
        self.state = State.AWAITING_HELLO
        self.principal: Principal | None = None
        self.conversation_id: UUID | None = None
        self._send_lock = asyncio.Lock()
        self._turns: dict[str, asyncio.Event] = {}  # client_msg_id -> cancel
        self._turn_ids: dict[UUID, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._invalid = 0

    def _move(self, to: State) -> None:
        allowed = {
            State.AWAITING_HELLO: {State.READY, State.CLOSED},
            State.READY: {State.CLOSED},
            State.CLOSED: set(),
        }
        if to not in allowed[self.state]:
            raise RuntimeError(f"connection cannot go from {self.state.value} to {to.value}")
        self.state = to

    async def send(self, frame: wire.Frame) -> None:
        if self.state is State.CLOSED:
            return
        if isinstance(frame, wire.Error):
            observe.errors.add(1, {"code": frame.code, "front_end": "ws"})
        async with self._send_lock:
            try:
                await self.ws.send_text(frame.model_dump_json(exclude_none=True))
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.state = State.CLOSED  # the client went away; its turns run on

    async def close(self, code: int, reason: str) -> None:
        if self.state is not State.CLOSED:
            self._move(State.CLOSED)
            with contextlib.suppress(RuntimeError, OSError):
                await self.ws.close(code, reason[:120])

    async def serve(self) -> None:
        await self.ws.accept()
        header = self.ws.headers.get("authorization")
        try:
            if header is not None:
                await self._authenticate(bearer_key(header), None)
            else:
                await self._await_hello()
        except InvalidApiKey as exc:
            await self.close(CLOSE_UNAUTHENTICATED, exc.message)
            return
        except TooManyConnections as exc:
            await self.send(wire.Error.of(exc))
            await self.close(CLOSE_TRY_AGAIN, exc.message)
            return
        except MacaronError as exc:
            await self.send(wire.Error.of(exc))
            await self.close(CLOSE_POLICY, exc.message)
            return
        assert self.principal is not None  # set by _authenticate
        try:
            await self._receive_loop()
        finally:
            self.gate.leave(self.principal)

    async def _await_hello(self) -> None:
        try:
            message = await asyncio.wait_for(self.ws.receive(), HELLO_TIMEOUT_S)
        except TimeoutError:
            raise InvalidApiKey("no hello frame with an API key arrived in time") from None
        text = message.get("text")
        if text is None:
            raise InvalidApiKey("the first frame must be a hello frame with an API key")
        try:
            frame = wire.parse_client_frame(text)
        except InvalidFrame as exc:
            raise InvalidApiKey(f"the first frame must be hello: {exc.message}") from None
        if not isinstance(frame, wire.Hello) or frame.api_key is None:
            raise InvalidApiKey("the first frame must be a hello frame with an API key")
        await self._authenticate(frame.api_key, frame.conversation_id)

    async def _authenticate(self, key: str, conversation_id: UUID | None) -> None:
        principal = await self.gate.authenticate(key, "chat")
        self.gate.enter(principal)
        self.principal = principal
        try:
            if conversation_id is not None:
                await self.service.conversation(principal, conversation_id)
                self.conversation_id = conversation_id
        except MacaronError:
            self.gate.leave(principal)
            raise
        self._move(State.READY)
        await self._ready()

    async def _ready(self) -> None:
        assert self.principal is not None
        await self.send(
            wire.Ready(
                conversation_id=self.conversation_id,
                tenant_id=self.principal.tenant_id,
                release_id=self.service.release.release_id,
                specialists=self.service.specialists,
            )
        )

    async def _receive_loop(self) -> None:
        while self.state is State.READY:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                self.state = State.CLOSED
                return
            text = message.get("text")
            try:
                if text is None:
                    raise InvalidFrame("binary frames are not part of protocol v1; send JSON text")
                await self._dispatch(wire.parse_client_frame(text))
            except InvalidFrame as exc:
                self._invalid += 1
                await self.send(wire.Error.of(exc))
                if self._invalid >= MAX_INVALID_FRAMES:
                    await self.close(CLOSE_POLICY, f"{MAX_INVALID_FRAMES} invalid frames")
            except MacaronError as exc:
                await self.send(wire.Error.of(exc))

    async def _dispatch(self, frame: wire.ClientFrame) -> None:
        assert self.principal is not None
        match frame:
            case wire.Ping():
                await self.send(wire.Pong())
            case wire.Hello():
                if frame.conversation_id is not None:
                    await self.service.conversation(self.principal, frame.conversation_id)
                self.conversation_id = frame.conversation_id
                await self._ready()
            case wire.UserTurn():
                self._start_turn(
                    TurnRequest(
                        client_msg_id=frame.client_msg_id,
                        content=frame.content,
                        conversation_id=frame.conversation_id or self.conversation_id,
                        specialist_hint=frame.specialist_hint,
                    )
                )
            case wire.Feedback():
                turn = await self.service.feedback(
                    self.principal, self.conversation_id, frame.command()
                )
                if frame.kind == "regenerate":  # a new answer to the same words
                    self._start_turn(regeneration(turn, self.conversation_id))
            case wire.Reroute():
                self._start_turn(
                    await self.service.reroute(
                        self.principal, self.conversation_id, frame.command()
                    )
                )
            case wire.UIEvent():
                request = await self.service.ui_event_turn(
                    self.principal, self.conversation_id, frame.command()
                )
                self._start_turn(request)
            case wire.Cancel():
                msg_id = self._turn_ids.get(frame.turn_id)
                if msg_id is None or msg_id not in self._turns:
                    raise TurnNotFound(f"turn {frame.turn_id} is not running on this connection")
                self._turns[msg_id].set()

    def _start_turn(self, request: TurnRequest) -> None:
        if request.client_msg_id in self._turns:
            raise InvalidFrame(f"client_msg_id {request.client_msg_id!r} is already running")
        cancel = asyncio.Event()
        self._turns[request.client_msg_id] = cancel
        task = asyncio.create_task(self._turn(request, cancel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _turn(self, request: TurnRequest, cancel: asyncio.Event) -> None:
        assert self.principal is not None

        async def sink(item: items.TurnItem) -> None:
            if isinstance(item, items.TurnStarted):
                self.conversation_id = item.conversation_id
                self._turn_ids[item.turn_id] = request.client_msg_id
            await self.send(frame_of(item))

        with observe.tracer.start_as_current_span(
            "ws.turn",
            attributes={
                "macaron.tenant_id": self.principal.tenant_id,
                "macaron.client_msg_id": request.client_msg_id,
            },
        ) as span:
            try:
                await self.service.run_turn(self.principal, request, sink, cancel)
            except MacaronError as exc:
                span.set_status(StatusCode.ERROR, exc.code)
                await self.send(wire.Error.of(exc))
            finally:
                del self._turns[request.client_msg_id]


def frame_of(item: items.TurnItem) -> wire.Frame:
    """The protocol v1 frame that shows a turn item to the client."""
    match item:
        case items.TurnStarted():
            return wire.TurnStarted(
                turn_id=item.turn_id,
                conversation_id=item.conversation_id,
                client_msg_id=item.client_msg_id,
                specialist=item.specialist,
                adapter_version=item.adapter_version,
                release_id=item.release_id,
            )
        case items.TextDelta():
            return wire.Token(turn_id=item.turn_id, delta=item.delta)
        case items.GenUITree():
            return wire.GenUI(turn_id=item.turn_id, tree=item.tree)
        case items.ActionDone():
            return wire.Action(
                turn_id=item.turn_id, name=item.name, args=item.args, result=item.result, ok=item.ok
            )
        case items.TurnEnded():
            usage = wire.Usage(
                prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens
            )
            return wire.TurnCompleted(
                turn_id=item.turn_id,
                usage=usage,
                latency_ms=item.latency_ms,
                finish_reason=item.finish_reason,
                resent=item.resent,
            )
