"""The router in the learning loop: a router run trains a successor classifier on the seed
examples and every routing label of the log up to the run's end, judges it against the router
of the active release on the contract's routing suite (``core.contract.decide_routing``), and,
when it passes, registers it, files a release naming it (adapters and harness unchanged) and
has the serving process promote it. ``RouterEvaluated`` records the verdict either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from core.contract import Decision, decide_routing
from core.errors import ContractInvalid
from core.events import NewEvent, RouterEvaluated, RoutingLabelled
from core.ids import derived_id
from core.release import Release
from core.routing import ROUTER_RUNS_KEY, ROUTING_KEY, LabelledTurn, RouterModel
from infra.jsonl import load_jsonl
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import active_release, create_release
from infra.postgres.routers import (
    claim_router_run,
    finish_router_run,
    register_router,
    router_model,
    router_run,
)
from learners.contract import load_contract
from learners.loop import RunFailed, Runtime

PROMOTION_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RouterOutcome:
    """What a router run ended as: ``passed``, ``refused`` (or what a redelivery found)."""

    status: str
    router_version: str | None = None
    release_id: str | None = None


def train_router_run(rt: Runtime, run_id: UUID) -> RouterOutcome:
    """Train, judge and (when it passes) promote the run's router successor; a run that is not
    queued (a redelivery) is reported as it ended."""
    with rt.pool.connection() as conn, conn.transaction():
        run = claim_router_run(conn, run_id)
        if run is None:
            done = router_run(conn, run_id)
            if done is None:
                raise RunFailed(f"no router run {run_id}")
            return RouterOutcome(done["status"], done["router_version"], done["release_id"])
        release = active_release(conn)
        parent = router_model(conn, release.router_version)
    try:
        return _judged(rt, run, release, parent)
    except Exception as exc:
        with rt.pool.connection() as conn, conn.transaction():
            finish_router_run(conn, run_id, status="failed", error=repr(exc)[:2000])
        raise


def _judged(
    rt: Runtime, run: dict[str, Any], release: Release, parent: RouterModel
) -> RouterOutcome:
    contract = load_contract(rt.contract_path)
    if contract.routing is None:
        raise ContractInvalid(f"contract {contract.version} has no routing suite")
    suite = load_jsonl(
        rt.contract_path.parent / contract.routing.suite, LabelledTurn, ContractInvalid
    )
    end = {int(p): o for p, o in run["labels_end"].items()}
    labels = [
        e.payload
        for e in rt.log.read(key=ROUTING_KEY, end=end, types=["RoutingLabelled"])
        if isinstance(e.payload, RoutingLabelled)
    ]
    trainer = rt.router_trainer()
    candidate = trainer.retrain(labels)
    judged = trainer.outcomes(candidate, suite), trainer.outcomes(parent, suite)
    decision = decide_routing(*judged, contract.routing)
    accuracy = _accuracy(judged[0]), _accuracy(judged[1])
    passed = decision.passed and candidate.version != parent.version
    reasons = decision.reasons or ([] if passed else ["the labels change nothing"])
    child = release.successor(router_version=candidate.version) if passed else None
    run_id = run["run_id"]
    with rt.pool.connection() as conn, conn.transaction():
        register_router(conn, candidate, parent=parent.version)
        if child is not None:
            create_release(conn, child, active=False)
        finish_router_run(
            conn,
            run_id,
            status="passed" if passed else "refused",
            parent=parent.version,
            router_version=candidate.version,
            release_id=None if child is None else child.release_id,
            evaluation=_evaluation(decision, reasons, len(labels)),
        )
    rt.log.append([_evaluated(run_id, (candidate, parent), accuracy, contract.version, reasons)])
    if child is None:
        return RouterOutcome("refused", candidate.version)
    request = request_promotion(rt.pool, child.release_id, requested_by=f"router run {run_id}")
    final = wait_for_request(rt.pool, request, PROMOTION_TIMEOUT_S)
    return RouterOutcome(f"promotion {final['status']}", candidate.version, child.release_id)


def _evaluation(decision: Decision, reasons: list[str], labels: int) -> dict[str, Any]:
    return {
        "labels": labels,
        "gain": decision.gain,
        "p_value": decision.p_value,
        "recall_drops": decision.regressions,
        "reasons": reasons,
    }


def _accuracy(outcomes: dict[str, list[bool]]) -> float:
    every = [ok for turns in outcomes.values() for ok in turns]
    return sum(every) / len(every)


def _evaluated(
    run_id: UUID,
    models: tuple[RouterModel, RouterModel],
    accuracy: tuple[float, float],
    contract_version: str,
    reasons: list[str],
) -> NewEvent:
    """The verdict on the candidate (first) against its parent (second)."""
    return NewEvent(
        payload=RouterEvaluated(
            run_id=run_id,
            router_version=models[0].version,
            parent_router_version=models[1].version,
            contract_version=contract_version,
            candidate_accuracy=accuracy[0],
            parent_accuracy=accuracy[1],
            passed=not reasons,
            reasons=reasons,
        ),
        tenant_id="system",
        key=ROUTER_RUNS_KEY,
        event_id=derived_id("router-evaluated", run_id),
        causation_id=run_id,
    )
