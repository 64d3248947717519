"""The admin API (keys with the ``admin`` scope): lineage, live contract scores, promotion and
rollback by hand, forgetting a tenant; and one turn's audit, which a ``chat`` key may also ask
for its own tenant's turns (the training records counted, not listed)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core.auth import Principal, bearer_key
from core.errors import (
    PromotionFailed,
    PromotionInProgress,
    ReleaseNotFound,
    TrainingInFlight,
    TurnNotFound,
)
from core.log import EventLog
from core.registry import ContractScore, LiveScore
from infra.postgres.db import Pool
from infra.postgres.exposure import forgotten_tenants
from infra.postgres.lineage import audit, lineage, releases
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import active_release
from infra.postgres.runs import contract_scores
from infra.postgres.scores import live_scores
from infra.postgres.turn_audit import Shown, audit_turn
from server.entrypoints.bodies import read_json, read_query
from server.entrypoints.gate import Gate
from server.exposure import exposure
from server.forgetting import forget_tenant
from server.unlearning import promote_fallback, retrain_forgotten

PROMOTION_TIMEOUT_S = 120.0
_log = logging.getLogger(__name__)


class PromoteBody(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    release_id: str = Field(min_length=1, max_length=100)


async def _admin(request: Request) -> Principal:
    gate: Gate = request.app.state.gate
    return await gate.authenticate(bearer_key(request.headers.get("authorization")), "admin")


async def lineage_endpoint(request: Request) -> Response:
    await _admin(request)
    pool = request.app.state.gate.pool
    ref = request.path_params["ref"]

    def walk() -> list[dict[str, Any]]:
        with pool.connection() as conn:
            return [step.model_dump(mode="json") for step in lineage(conn, ref)]

    return JSONResponse({"ref": ref, "lineage": await asyncio.to_thread(walk)})


async def releases_endpoint(request: Request) -> Response:
    """``GET /admin/releases``: every release, newest first (the console's timeline)."""
    await _admin(request)
    pool = request.app.state.gate.pool

    def read() -> list[dict[str, Any]]:
        with pool.connection() as conn:
            return [step.model_dump(mode="json") for step in releases(conn)]

    return JSONResponse({"releases": await asyncio.to_thread(read)})


async def audit_endpoint(request: Request) -> Response:
    """``GET /admin/audit``: ``macaron audit verify`` (every key's hash chain, every adapter's
    files against their sha256); it reads the whole log."""
    await _admin(request)
    pool = request.app.state.gate.pool
    log, store = request.app.state.chat.log, request.app.state.store

    def verify() -> dict[str, Any]:
        with pool.connection() as conn:
            report = audit(conn, log, store)
        return {**report.model_dump(), "ok": report.ok}

    return JSONResponse(await asyncio.to_thread(verify))


async def turn_audit_endpoint(request: Request) -> Response:
    """``GET /admin/turns/{turn_id}/audit``: an admin key audits any turn, with the records that
    trained its adapter and their content; a chat key its own tenant's, with their counts."""
    gate: Gate = request.app.state.gate
    principal = await gate.identify(bearer_key(request.headers.get("authorization")))
    admin = principal.allows("admin")
    if not admin:
        principal.require("chat")
    try:
        turn_id = UUID(request.path_params["turn_id"])
    except ValueError:
        raise TurnNotFound("no such turn") from None
    log = request.app.state.chat.log

    def read() -> dict[str, Any]:
        with gate.pool.connection() as conn:
            tenant = None if admin else principal.tenant_id
            shown: Shown = "content" if admin else "counts"
            report = audit_turn(conn, log, turn_id, tenant_id=tenant, records=shown)
        return {**report.model_dump(mode="json"), "chain_ok": report.chain_ok}

    return JSONResponse(await asyncio.to_thread(read))


async def scores_endpoint(request: Request) -> Response:
    """Live scores per release and specialist, as counters and rates; and each release's
    contract scores per suite (``contract``), as its evaluations measured them."""
    await _admin(request)
    pool = request.app.state.gate.pool

    def read() -> dict[str, Any]:
        with pool.connection() as conn:
            return {
                "scores": [_rates(row) for row in live_scores(conn)],
                "contract": [_contract(row) for row in contract_scores(conn)],
            }

    return JSONResponse(await asyncio.to_thread(read))


def _ratio(part: float, whole: float) -> float | None:
    return None if not whole else part / whole


def _rates(row: LiveScore) -> dict[str, Any]:
    turns = row.turns
    ratio = _ratio
    return {
        **asdict(row),
        "thumbs_up_rate": ratio(row.ups, turns),
        "edit_rate": ratio(row.edits, turns),
        "action_success_rate": ratio(row.actions_ok, row.actions),
        "genui_validity_rate": ratio(row.genui_valid, row.genui),
        "mean_latency_ms": ratio(row.latency_ms, turns),
    }


def _contract(row: ContractScore) -> dict[str, Any]:
    return {**asdict(row), "released_at": row.released_at.isoformat()}


class ForgetQuery(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    retrain: bool = False


async def forget_endpoint(request: Request) -> Response:
    """``DELETE /admin/tenants/{tenant_id}[?retrain=true]``: ``macaron tenants forget
    [--retrain]`` (idempotent). The server does not import the queue: it queues the unlearning
    runs and records them (``UnlearningRequested``), and the stream processors hand them to the
    workers."""
    principal = await _admin(request)
    query = read_query(request, ForgetQuery)
    state = request.app.state
    tenant = request.path_params["tenant_id"]
    done = await asyncio.to_thread(
        forget_tenant, state.gate.pool, state.chat.log, state.data_keys, tenant
    )
    _log.info("tenant %s forgotten by admin key %s", tenant, principal.key_id)
    answer = {"forgotten": True, **asdict(done), "event_id": str(done.event_id)}
    if query.retrain:
        answer["retraining"] = await asyncio.to_thread(
            _retrain, state.gate.pool, state.chat.log, tenant
        )
    return JSONResponse(answer)


def _retrain(pool: Pool, log: EventLog, tenant: str) -> dict[str, Any]:
    """Queue and record the unlearning of every forgotten tenant; ask for the fallback."""
    try:
        unlearning = retrain_forgotten(pool, log, dispatch=True)
    except TrainingInFlight as exc:
        raise TrainingInFlight(
            f"tenant {tenant} is forgotten, but {exc.message}: ask again with ?retrain=true "
            "once it is done"
        ) from exc
    fallback, pending = unlearning.fallback, None
    if fallback is not None:
        by = "DELETE /admin/tenants/{id}?retrain=true"
        try:
            promote_fallback(pool, fallback, unlearning.restored, by)
        except PromotionInProgress as exc:
            pending = f"{exc.message}: promote {fallback.release_id} once it is done"
    router = unlearning.router_run
    return {
        "runs": [
            {
                "run_id": str(r.run_id),
                "specialist": r.specialist,
                "parent": r.parent,
                "records": r.records,
            }
            for r in unlearning.runs
        ],
        "router_run": None if router is None else str(router.event_id),
        "fallback_release_id": None if fallback is None else fallback.release_id,
        "restored": list(unlearning.restored),
        "fallback_pending": pending,
    }


async def exposure_endpoint(request: Request) -> Response:
    """``GET /admin/exposure``: the adapters and releases that learned from forgotten tenants'
    records (``macaron tenants exposure``), with how many tenants are forgotten."""
    await _admin(request)
    pool, log = request.app.state.gate.pool, request.app.state.chat.log

    def read() -> dict[str, Any]:
        with pool.connection() as conn:
            tenants = forgotten_tenants(conn)
            found = exposure(conn, log, tenants)
        return {"forgotten_tenants": len(tenants), **asdict(found)}

    return JSONResponse(await asyncio.to_thread(read))


async def promote_endpoint(request: Request) -> Response:
    principal = await _admin(request)
    body = await read_json(request, PromoteBody)
    return await _carry_out(request, body.release_id, "promote", principal)


async def rollback_endpoint(request: Request) -> Response:
    """``POST /admin/rollback``: to the parent of the registry's active release (not of the
    one this server serves, which follows a flip a moment later)."""
    principal = await _admin(request)
    pool = request.app.state.gate.pool

    def active_parent() -> str | None:
        with pool.connection() as conn:
            return active_release(conn).parent_release_id

    parent = await asyncio.to_thread(active_parent)
    if parent is None:
        raise ReleaseNotFound("the active release is the root: there is nothing to roll back to")
    return await _carry_out(request, parent, "rollback", principal)


async def _carry_out(request: Request, release_id: str, kind: str, who: Principal) -> Response:
    pool = request.app.state.gate.pool
    by = f"admin key {who.key_id} ({who.tenant_id})"
    request_id = await asyncio.to_thread(
        lambda: request_promotion(pool, release_id, kind=kind, requested_by=by)
    )
    final = await asyncio.to_thread(wait_for_request, pool, request_id, PROMOTION_TIMEOUT_S)
    if final.status != "done":
        raise PromotionFailed(f"{kind} of {release_id}: {final.reason or final.status}")
    done = {"release_id": release_id, "kind": kind, "status": "done", "note": final.reason}
    return JSONResponse(done)
