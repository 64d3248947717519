"""The router in the learning loop, with real PostgreSQL, Redis, a Celery worker process and
the real embedding model: users' reroutes and thumbs-up start a router run at the default
threshold; the worker trains a successor on them, judges it on the contract's routing suite and
follow-ups, and the server promotes a release naming it, swapping the router in the flip; a
successor taught wrong is refused."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from subprocess import Popen
from uuid import uuid4

import pytest
from websockets.sync.client import ClientConnection

from core.errors import ContractInvalid, RouterErased
from core.events import (
    NewEvent,
    ReleasePromoted,
    RouterDecided,
    RouterEvaluated,
    RouterTrainingRequested,
    RoutingLabelled,
)
from core.routing import ROUTING_KEY
from core.routing_labels import LabelledTurn
from core.settings import Settings
from core.tasks import Task
from infra.jsonl import load_jsonl
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.routers import queue_router_run, router_model, router_parent, router_run
from learners.queue import configure as configure_celery
from learners.routing.run import train_router_run
from learners.tasks import BANK_V1, load_bank
from macaron import wiring
from server.exposure import exposure
from server.router import RouterService, SentenceEmbedder
from tests.factories import run_macaron
from tests.integration.test_learning_loop import env_of
from tests.serving import (
    Running,
    celery_worker,
    following,
    frames_until,
    running_server,
    send,
)

SUITE = Path(__file__).resolve().parents[2] / "learners" / "routing-v1.jsonl"


def teach(ws: ClientConnection, tasks: list[Task]) -> Counter[str]:
    """Each task's prompt in a conversation of its own, without a hint: a turn the router sent
    elsewhere is rerouted to the task's specialist (a ``correction``), one it got right gets a
    thumbs-up (``up``); returns how many of each."""
    given: Counter[str] = Counter()
    for n, task in enumerate(tasks):
        send(ws, type="hello")
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id=f"t{n}", content=task.prompt)
        first = frames_until(ws, "turn_completed")[0]
        if first["specialist"] == task.specialist:
            send(ws, type="feedback", turn_id=first["turn_id"], kind="up")
            given["up"] += 1
        else:
            send(ws, type="reroute", turn_id=first["turn_id"], specialist=task.specialist)
            frames_until(ws, "turn_completed")
            given["correction"] += 1
    return given


def test_reroutes_train_a_router_that_the_loop_judges_and_promotes_by_default(
    database_url: str, celery_redis_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=1000,
        harness_proposals=False,
        turns_per_minute=1000,
        max_new_tokens=8,
        task_visibility_timeout=120,
    )
    configure_celery(settings)
    own = wiring.seed_router(SentenceEmbedder())  # the test swaps its classifier
    seed_version = own.version
    tasks = load_bank(BANK_V1)
    traffic = random.Random(0).sample(tasks, settings.router_threshold)
    log_path = tmp_path / "worker.log"
    with (
        celery_worker(settings, log_path) as worker,
        running_server(settings, router=own) as served,
        following(served),
        served.connect(served.key("router-user")) as ws,
    ):
        frames_until(ws, "ready")
        given = teach(ws, traffic)
        deadline = time.monotonic() + 300
        while own.version == seed_version:
            assert worker.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)

        events = [e.payload for e in served.events()]
        labels = [p for p in events if isinstance(p, RoutingLabelled)]
        assert Counter(label.source for label in labels) == given and given["correction"] > 0
        assert {(label.text, label.specialist) for label in labels} == {
            (task.prompt, task.specialist) for task in traffic
        }
        [requested] = [p for p in events if isinstance(p, RouterTrainingRequested)]
        assert requested.labels == len(traffic) == Settings.model_fields["router_threshold"].default
        [evaluated] = [p for p in events if isinstance(p, RouterEvaluated)]
        assert evaluated.run_id == requested.run_id and evaluated.passed, evaluated.reasons
        assert evaluated.parent_router_version == seed_version
        assert evaluated.router_version == own.version
        assert evaluated.candidate_accuracy >= evaluated.parent_accuracy - 0.03
        release = served.server.chat.release
        assert release.router_version == own.version
        assert any(
            isinstance(p, ReleasePromoted) and p.release_id == release.release_id for p in events
        )
        with served.server.pool.connection() as conn:
            assert router_model(conn, own.version).version == own.version

        send(ws, type="user_turn", client_msg_id="after", content="Tell me a joke.")
        frames_until(ws, "turn_completed")
        # A short follow-up is routed with its conversation by the promoted router.
        send(ws, type="user_turn", client_msg_id="follow-up", content="make it warmer")
        frames_until(ws, "turn_completed")
        decided = [e.payload for e in served.events() if isinstance(e.payload, RouterDecided)]
        assert decided[-1].router_version == decided[-2].router_version == own.version
        assert decided[-1].previous == decided[-2].specialist == decided[-1].specialist

        # A redelivery of the run after its promotion asks for nothing: its router serves.
        redelivered = train_router_run(
            wiring.learning_runtime(settings, served.server.pool), requested.run_id
        )
        assert (redelivered.status, redelivered.release_id) == ("promoted", release.release_id)
        evaluations = [e.payload for e in served.events() if isinstance(e.payload, RouterEvaluated)]
        assert evaluations == [evaluated]  # the verdict's id is derived: recorded once
        assert_router_unlearns(served, own, worker, log_path)


def assert_router_unlearns(
    served: Running, own: RouterService, worker: Popen[bytes], log_path: Path
) -> None:
    """Forgetting the user whose labels the active router was fitted on, with ``--retrain``,
    queues a router run that refits without them; it is judged and promoted like any other,
    and no router the server now routes with saw them."""
    exposed = own.version
    with served.server.pool.connection() as conn:
        assert exposure(conn, served.server.log, ["router-user"]).routers == (exposed,)
    forgot = run_macaron("tenants", "forget", "router-user", "--yes", "--retrain", **env_of(served))
    assert forgot.returncode == 0, forgot.stdout + forgot.stderr
    assert "queued router run" in forgot.stdout
    deadline = time.monotonic() + 300
    while own.version == exposed:
        assert worker.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.5)
    [unlearned] = [
        e.payload
        for e in served.events()
        if isinstance(e.payload, RouterEvaluated) and e.payload.parent_router_version == exposed
    ]
    [requested] = [
        e.payload
        for e in served.events()
        if isinstance(e.payload, RouterTrainingRequested) and e.payload.run_id == unlearned.run_id
    ]
    assert unlearned.passed and requested.labels == 0  # the user's labels read as forgotten
    with served.server.pool.connection() as conn:
        found = exposure(conn, served.server.log, ["router-user"])
        judged = router_run(conn, unlearned.run_id)
        fallback = router_parent(conn, exposed)  # the seed router, which saw no label
        reason = conn.execute(
            "SELECT reason FROM promotions WHERE to_release_id = %s",
            (served.server.chat.release.release_id,),
        ).fetchone()
    assert found.routers == (exposed,) and not found.active
    assert reason is not None and "unlearns 1 forgotten tenant(s)" in reason["reason"]
    # Judged against the router it would fall back to, not the exposed one it replaces.
    assert judged is not None and judged.evaluation is not None and fallback is not None
    assert judged.judged_against == judged.evaluation["judged_against"] == fallback
    assert_exposed_router_erased(served, exposed)


def assert_exposed_router_erased(served: Running, exposed: str) -> None:
    """The exposed router's weights leave the registry once the successor routes (its row
    stays: releases name it); a rollback to the release that routed with it is refused."""
    pool = served.server.pool
    deadline = time.monotonic() + 60
    while True:  # erased after the flip
        with pool.connection() as conn:
            found = exposure(conn, served.server.log, ["router-user"])
        if found.erased == (exposed,):
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.2)
    with pool.connection() as conn:
        with pytest.raises(RouterErased, match="learned from a forgotten tenant"):
            router_model(conn, exposed)
        row = conn.execute(
            "SELECT release_id FROM releases WHERE router_version = %s "
            "ORDER BY created_at DESC LIMIT 1",
            (exposed,),
        ).fetchone()
    assert row is not None
    back = request_promotion(pool, row["release_id"], kind="rollback", requested_by="t")
    final = wait_for_request(pool, back, 60)
    assert final.status == "failed" and f"routes with {exposed}" in (final.reason or "")


def test_a_router_taught_wrong_is_refused_and_the_active_one_routes_on(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Corrections that send the routing suite's coding turns to chat: the successor loses
    coding's recall, the contract refuses it, and no release names it. A label naming a
    specialist the router does not know is left out of the fit, and counted."""
    settings = Settings(home=tmp_path / "home", database_url=database_url, model_dir=tiny_model)
    own = wiring.seed_router(SentenceEmbedder())
    seed_version = own.version
    suite = load_jsonl(SUITE, LabelledTurn, ContractInvalid)
    wrong = [
        RoutingLabelled(
            label_id=uuid4(), turn_id=uuid4(), text=t.text, specialist="chat", source="correction"
        )
        for t in suite
        if t.specialist == "coding"
    ]
    unknown = RoutingLabelled(
        label_id=uuid4(),
        turn_id=uuid4(),
        text="Is a verbal deal binding?",
        specialist="legal",
        source="correction",
    )
    with running_server(settings, router=own) as served:
        before = served.server.chat.release
        served.server.log.append(
            [
                NewEvent(payload=label, tenant_id="system", key=ROUTING_KEY)
                for label in [*wrong, unknown]
            ]
        )
        run_id = uuid4()
        with served.server.pool.connection() as conn, conn.transaction():
            assert queue_router_run(conn, run_id, served.server.log.end_positions(), len(wrong))
        rt = wiring.learning_runtime(settings, served.server.pool)
        outcome = train_router_run(rt, run_id)
        assert outcome.status == "refused" and outcome.release_id is None
        [evaluated] = [e.payload for e in served.events() if isinstance(e.payload, RouterEvaluated)]
        assert not evaluated.passed and evaluated.candidate_accuracy < evaluated.parent_accuracy
        assert any("coding" in reason for reason in evaluated.reasons), evaluated.reasons
        assert evaluated.labels_left_out == 1
        assert served.server.chat.release == before and own.version == seed_version
