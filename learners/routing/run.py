"""The router run: it trains a successor classifier on the seed examples and every routing
label of the log up to the run's end (``learners.routing.training``), judges it against the
router of the active release on the contract's routing suite (``core.contract.decide_routing``),
and, when it passes, registers it, files a release naming it (adapters and harness unchanged)
and has the serving process promote it. ``RouterEvaluated`` records the verdict either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from core.contract import RoutingRule, decide_routing
from core.errors import ContractInvalid
from core.events import NewEvent, RouterEvaluated
from core.ids import derived_id
from core.registry import RouterRun, RouterRunEnd
from core.routing import ROUTER_RUNS_KEY
from core.routing_labels import FollowUp, LabelledTurn, labels_of
from infra.jsonl import load_jsonl
from infra.postgres.promotions import promoted_once, request_promotion, wait_for_request
from infra.postgres.registry import active_release, file_release
from infra.postgres.routers import (
    claim_router_run,
    finish_router_run,
    register_router,
    router_model,
    router_run,
)
from learners.evaluation.contract_runner import load_contract
from learners.routing.training import logged_labels, router_fit
from learners.runtime import RunBusy, RunFailed, Runtime

PROMOTION_TIMEOUT_S = 300.0
LEASE_S = 600
"""A router run's lease: a worker that died mid-run leaves it to the next after this long."""


@dataclass(frozen=True)
class RouterOutcome:
    """What a router run ended as: ``refused``, ``promoted``, ``promotion failed``."""

    status: str
    router_version: str | None = None
    release_id: str | None = None


def train_router_run(rt: Runtime, run_id: UUID) -> RouterOutcome:
    """Train and judge the run's router successor, record the verdict, and have a release
    naming it promoted when it passed. A redelivered run that was judged already only records
    the verdict again and asks for the promotion it may lack; one a live worker holds is
    ``RunBusy``."""
    with rt.pool.connection() as conn, conn.transaction():
        run = claim_router_run(conn, run_id, LEASE_S)
        done = router_run(conn, run_id) if run is None else None
    if run is None:
        if done is None:
            raise RunFailed(f"no router run {run_id}")
        if done.status in ("queued", "running"):
            raise RunBusy(f"router run {run_id} is held by a worker whose lease is live")
        return _settled(rt, done)
    try:
        judged = _judged(rt, run)
    except Exception as exc:
        with rt.pool.connection() as conn, conn.transaction():
            finish_router_run(conn, run_id, RouterRunEnd(status="failed", error=repr(exc)[:2000]))
        raise
    return _settled(rt, judged)


def _judged(rt: Runtime, run: RouterRun) -> RouterRun:
    """Fit the successor, judge it against the active release's router (a run that unlearns
    forgotten tenants: against the router it would fall back to, ``judged_against``), register
    it, file the release naming it when it passed; returns the run as recorded."""
    with rt.pool.connection() as conn:
        release = active_release(conn)
        parent = router_model(conn, release.router_version)
        baseline = parent if run.judged_against is None else router_model(conn, run.judged_against)
    contract = load_contract(rt.contract_path)
    if contract.routing is None:
        raise ContractInvalid(f"contract {contract.version} has no routing suite")
    suite = routing_suite(rt.contract_path.parent, contract.routing)
    labels = logged_labels(rt.log, run.labels_end)
    trainer = rt.router_trainer()
    candidate = trainer.retrain(labels, router_fit(rt.log, parent.specialists))
    judged = trainer.outcomes(candidate, suite), trainer.outcomes(baseline, suite)
    decision = decide_routing(*judged, contract.routing)
    passed = decision.passed and candidate.version != parent.version
    child = release.successor(router_version=candidate.version) if passed else None
    evaluation = {
        "contract_version": contract.version,
        "labels": len(labels),
        "labels_left_out": sum(t.specialist not in parent.specialists for t in labels_of(labels)),
        "candidate_accuracy": _accuracy(judged[0]),
        "parent_accuracy": _accuracy(judged[1]),
        "judged_against": baseline.version,
        "gain": decision.gain,
        "p_value": decision.p_value,
        "recall_drops": decision.regressions,
        "reasons": decision.reasons or ([] if passed else ["the labels change nothing"]),
    }
    with rt.pool.connection() as conn, conn.transaction():
        register_router(conn, candidate, parent=parent.version)
        if child is not None:
            file_release(conn, child)
        finish_router_run(
            conn,
            run.run_id,
            RouterRunEnd(
                status="passed" if passed else "refused",
                parent=parent.version,
                router_version=candidate.version,
                release_id=None if child is None else child.release_id,
                evaluation=evaluation,
            ),
        )
        recorded = router_run(conn, run.run_id)
    if recorded is None:
        raise RunFailed(f"router run {run.run_id} is gone")
    return recorded


def routing_suite(folder: Path, rule: RoutingRule) -> list[LabelledTurn]:
    """The turns a routing rule judges on: its suite's, then its follow-ups (``FollowUp``)."""
    suite = load_jsonl(folder / rule.suite, LabelledTurn, ContractInvalid)
    if not suite:
        raise ContractInvalid(f"{folder / rule.suite}: the routing suite has no turns")
    if rule.follow_ups is None:
        return suite
    return [*suite, *load_jsonl(folder / rule.follow_ups, FollowUp, ContractInvalid)]


def _settled(rt: Runtime, run: RouterRun) -> RouterOutcome:
    """Record the verdict of a judged run (again, for a redelivery: its id is derived) and ask
    for the promotion of a passed run's release unless it was promoted once (as it is, or
    rebased onto a release promoted since; a rollback since is the operator's word)."""
    if run.status not in ("passed", "refused"):
        return RouterOutcome(run.status, run.router_version, run.release_id)
    rt.log.append([_evaluated(run)])
    if run.status == "refused":
        return RouterOutcome("refused", run.router_version)
    release_id = run.release_id
    if release_id is None:
        raise RunFailed(f"router run {run.run_id} passed without a release")
    with rt.pool.connection() as conn:
        if promoted_once(conn, release_id):  # perhaps rebased, perhaps rolled back since
            return RouterOutcome("promoted", run.router_version, release_id)
    by = f"router run {run.run_id}"
    if run.left_out_tenants:
        by += f", which unlearns {len(run.left_out_tenants)} forgotten tenant(s)"
    request = request_promotion(rt.pool, release_id, requested_by=by)
    final = wait_for_request(rt.pool, request, PROMOTION_TIMEOUT_S)
    status = "promoted" if final.status == "done" else f"promotion {final.status}"
    return RouterOutcome(status, run.router_version, run.release_id)


def _accuracy(outcomes: dict[str, list[bool]]) -> float:
    every = [ok for turns in outcomes.values() for ok in turns]
    return sum(every) / len(every)


def _evaluated(run: RouterRun) -> NewEvent:
    """``RouterEvaluated`` from the run as recorded."""
    evaluation = run.evaluation
    if evaluation is None or run.router_version is None or run.parent_router_version is None:
        raise RunFailed(f"router run {run.run_id} was judged without its evaluation")
    return NewEvent(
        payload=RouterEvaluated(
            run_id=run.run_id,
            router_version=run.router_version,
            parent_router_version=run.parent_router_version,
            contract_version=evaluation["contract_version"],
            candidate_accuracy=evaluation["candidate_accuracy"],
            parent_accuracy=evaluation["parent_accuracy"],
            passed=run.status == "passed",
            reasons=evaluation["reasons"],
            labels_left_out=evaluation.get("labels_left_out", 0),  # none counted before v2
        ),
        tenant_id="system",
        key=ROUTER_RUNS_KEY,
        event_id=derived_id("router-evaluated", run.run_id),
        causation_id=run.run_id,
    )
