"""The ASGI application: routes, and errors mapped to responses by type.

Data endpoints authenticate every request; the web UI's static files carry no data (the page
asks for a key and speaks the WebSocket protocol).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import UUID

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from core import errors
from core.auth import bearer_key
from core.routing import UnknownSpecialist
from infra import observe
from infra.postgres.data_keys import PostgresDataKeys
from infra.telemetry import metrics_exposition
from server.chat import ChatService
from server.entrypoints import admin, feedback_api
from server.entrypoints.gate import Gate
from server.entrypoints.openai_api import chat_completions, model, models
from server.entrypoints.ws import ChatConnection
from server.promotion import PromotionListener
from server.turns.transcript import transcript
from server.unlearning import ForgettingRaced

WEB = Path(__file__).parent / "web"

STATUS: dict[type[errors.MacaronError], int] = {
    errors.InvalidApiKey: 401,
    errors.Forbidden: 403,
    errors.InvalidFrame: 400,
    errors.PayloadTooLarge: 413,
    errors.ContextLengthExceeded: 400,
    errors.ConversationNotFound: 404,
    errors.TurnNotFound: 404,
    UnknownSpecialist: 404,
    errors.TurnInFlight: 409,
    errors.RateLimited: 429,
    errors.TooManyConnections: 429,
    errors.ReleaseNotFound: 404,
    errors.AdapterNotFound: 404,
    errors.GrammarInvalid: 422,
    errors.ConstraintUnsupported: 501,
    errors.PromotionInProgress: 409,
    errors.TrainingInFlight: 409,
    errors.PromotionFailed: 409,
    errors.EngineOverloaded: 503,
    errors.EngineUnavailable: 503,
    errors.LogUnavailable: 503,
    errors.RateLimitUnavailable: 503,
    errors.TenantNotFound: 404,
    errors.TenantForgotten: 410,
    ForgettingRaced: 409,
}


def status_of(exc: errors.MacaronError) -> int:
    """The HTTP status for an error: the nearest class in its hierarchy that has one."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


async def macaron_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.MacaronError)
    body = {"code": exc.code, "message": exc.message, "type": exc.code, "retryable": exc.retryable}
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, errors.InvalidApiKey) else None
    observe.errors.add(1, {"code": exc.code, "front_end": "http"})
    return JSONResponse({"error": body}, status_of(exc), headers=headers)


async def unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug, answered as a typed error too (the exception is still logged by the server)."""
    observe.errors.add(1, {"code": errors.MacaronError.code, "front_end": "http"})
    body = {
        "code": errors.MacaronError.code,
        "message": "internal error; it was logged",
        "type": errors.MacaronError.code,
        "retryable": False,
    }
    return JSONResponse({"error": body}, 500)


async def websocket_chat(websocket: WebSocket) -> None:
    state = websocket.app.state
    await ChatConnection(websocket, state.chat, state.gate).serve()


async def conversation(request: Request) -> Response:
    """A tenant's own conversation, turn by turn."""
    state = request.app.state
    principal = await state.gate.authenticate(
        bearer_key(request.headers.get("authorization")), "chat"
    )
    try:
        conversation_id = UUID(request.path_params["conversation_id"])
    except ValueError:
        raise errors.ConversationNotFound("no such conversation") from None
    found = await state.chat.conversation(principal, conversation_id)
    return JSONResponse(transcript(found).model_dump(mode="json"))


async def metrics(request: Request) -> Response:
    """Prometheus text, for a key with the ``metrics`` scope."""
    gate: Gate = request.app.state.gate
    await gate.authenticate(bearer_key(request.headers.get("authorization")), "metrics")
    body, content_type = metrics_exposition()
    return Response(body, media_type=content_type)


async def index(request: Request) -> Response:
    return FileResponse(WEB / "index.html")


async def console(request: Request) -> Response:
    """The operator console (its API calls need an admin key)."""
    return FileResponse(WEB / "console.html")


def create_app(
    chat: ChatService, gate: Gate, listener: PromotionListener, data_keys: PostgresDataKeys
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(listener.run(), name="promotion-listener")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = Starlette(
        lifespan=lifespan,
        routes=[
            Route("/", index),
            Route("/console", console),
            Mount("/web", StaticFiles(directory=WEB), name="web"),
            WebSocketRoute("/v1/ws", websocket_chat),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/v1/models/{model_id}", model),
            Route("/metrics", metrics),
            Route("/v1/conversations/{conversation_id}", conversation),
            Route(
                "/v1/conversations/{conversation_id}/turns/{turn_id}/feedback",
                feedback_api.feedback,
                methods=["POST"],
            ),
            Route(
                "/v1/conversations/{conversation_id}/turns/{turn_id}/reroute",
                feedback_api.reroute,
                methods=["POST"],
            ),
            Route("/admin/lineage/{ref}", admin.lineage_endpoint),
            Route("/admin/releases", admin.releases_endpoint),
            Route("/admin/audit", admin.audit_endpoint),
            Route("/admin/scores", admin.scores_endpoint),
            Route("/admin/turns/{turn_id}/audit", admin.turn_audit_endpoint),
            Route("/admin/promote", admin.promote_endpoint, methods=["POST"]),
            Route("/admin/rollback", admin.rollback_endpoint, methods=["POST"]),
            Route("/admin/tenants/{tenant_id}", admin.forget_endpoint, methods=["DELETE"]),
            Route("/admin/exposure", admin.exposure_endpoint),
        ],
        exception_handlers={errors.MacaronError: macaron_error, Exception: unexpected_error},
    )
    app.state.chat = chat
    app.state.gate = gate
    app.state.store = listener.store
    app.state.data_keys = data_keys
    return app
