"""Unlearning by replay, end to end on the tiny model, with real PostgreSQL, Redis and a Celery
worker process: two tenants teach genui, ``macaron train`` makes genui@1 from both and it is
promoted. ``DELETE /admin/tenants/learner?retrain=true`` then queues a successor of genui@0
on the same range without the learner's records (the stream processors hand it to the worker,
``UnlearningRequested``); the worker trains it, the contract judges it
against the release it would fall back to, and it is promoted with a reason that names the
forgetting. Its lineage holds no record of the forgotten tenant, whose words are in no table,
file or log. Forgetting the other tenant too leaves genui@2 nothing to learn from: genui@0
goes back in place (``macaron tenants forget bystander --retrain``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from core.events import CandidateTrained, ReleasePromoted, TurnReceived
from core.settings import Settings
from infra.postgres.lineage import run_detail
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import active_release
from learners.queue import configure as configure_celery
from server.exposure import exposure
from server.router import RouterService
from tests.factories import run_macaron
from tests.integration.test_forget import admin, database_text
from tests.integration.test_learning_loop import ANSWER, DATA, env_of
from tests.serving import (
    Running,
    celery_worker,
    following,
    frames_until,
    running_server,
    send,
    wait_for_promotion,
)

SECRET = f"learner-secret-{uuid.uuid4().hex[:12]}"


def test_retraining_promotes_a_successor_that_never_saw_the_forgotten_tenant(
    database_url: str,
    celery_redis_url: str,
    tiny_model: Path,
    router: RouterService,
    tmp_path: Path,
) -> None:
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=1000,  # trained by hand
        harness_proposals=True,  # a proposal follows each run: its exemplars must hold no words
        contract_path=DATA / "contract-e2e.yaml",
        training_config=DATA / "training-e2e.yaml",
        task_visibility_timeout=120,
        turns_per_minute=1000,
        max_new_tokens=24,
    )
    configure_celery(settings)
    log_path = tmp_path / "worker.log"
    with (
        running_server(settings, router=router) as served,
        celery_worker(settings, log_path) as worker,
        following(served),
    ):
        env = env_of(served)
        for tenant in ("learner", "bystander"):
            teach(served, tenant)
        trained = run_macaron("train", "genui", **env)
        assert trained.returncode == 0, trained.stdout + trained.stderr
        first = wait_for_promotion(served, log_path, worker)
        assert exposure_of(served, "learner") == (["genui@1"], True)
        assert any(SECRET in str(e.payload) for e in served.events() if is_turn(e.payload))

        forgot = httpx.delete(
            f"{served.http}/admin/tenants/learner?retrain=true", headers=admin(served), timeout=60
        )
        assert forgot.status_code == 200, forgot.text
        runs = forgot.json()["retraining"]["runs"]  # queued here, enqueued by the processors
        assert [(r["specialist"], r["parent"]) for r in runs] == [("genui", "genui@0")]
        second = wait_for_promotion(served, log_path, worker, parent=first.release_id)
        assert_unlearned(served, second, log_path)
        assert_erased(served, "learner", ["genui@1"], refused=first.release_id)

        again = run_macaron("tenants", "forget", "bystander", "--yes", "--retrain", **env)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "genui@0 back in place" in again.stdout
        wait_for_promotion(served, log_path, worker, parent=second.release_id)
        with served.server.pool.connection() as conn:
            assert active_release(conn).adapters["genui"].name == "genui@0"
        assert exposure_of(served, "bystander") == (["genui@1", "genui@2"], False)
        assert_erased(served, "bystander", ["genui@1", "genui@2"], refused=second.release_id)
        with served.server.pool.connection() as conn:  # proposals followed the runs, wordless
            proposed = conn.execute(
                "SELECT count(*) AS n FROM training_runs WHERE kind = 'harness'"
            ).fetchone()
            specs = [str(r["spec"]) for r in conn.execute("SELECT spec FROM harness_versions")]
        assert proposed is not None and proposed["n"] >= 1
        assert not any(SECRET in spec for spec in specs)


def teach(served: Running, tenant: str) -> None:
    """Genui turns the tenant corrects with the answer it wanted; the learner's prompts hold
    its secret."""
    words = f" {SECRET}" if tenant == "learner" else ""
    with served.connect(served.key(tenant)) as ws:
        frames_until(ws, "ready")
        for n, prompt in enumerate(["Show my build.", "Status please.", "Render health."]):
            send(
                ws,
                type="user_turn",
                client_msg_id=f"{tenant}-{n}",
                content=prompt + words,
                specialist_hint="genui",
            )
            turn_id = frames_until(ws, "turn_completed")[0]["turn_id"]
            send(ws, type="feedback", turn_id=turn_id, kind="edit", edited_text=ANSWER)
        send(ws, type="ping")
        frames_until(ws, "pong")


def assert_erased(served: Running, tenant: str, names: list[str], refused: str) -> None:
    """Once the flip replaced them, the weights of the adapters that learned from ``tenant``
    leave the artifact store (the registry keeps their records and says so), the audit passes
    over them, and a rollback to the release that served them is refused."""
    store = served.settings.home / "adapters"
    deadline = time.monotonic() + 60
    while True:  # said at the flip; the files go once the engine has let them go
        erased = erased_rows(served)
        if sorted(erased) == names and not any(
            (store / erased[name]["sha256"]).exists() for name in names
        ):
            break
        assert time.monotonic() < deadline, f"{names} not erased: {erased}"
        time.sleep(0.5)
    assert erased_of(served, tenant) == names
    assert {erased[name]["reason"] for name in names} == {"learned from a forgotten tenant"}
    audited = run_macaron("audit", "verify", **env_of(served))
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert f"({len(erased)} erased)" in audited.stdout
    listed = run_macaron("tenants", "exposure", tenant, **env_of(served))
    assert f"{names[0]} (weights erased)" in listed.stdout, listed.stdout
    back = request_promotion(served.server.pool, refused, kind="rollback", requested_by="t")
    final = wait_for_request(served.server.pool, back, 60)
    reason = final.reason or ""
    assert final.status == "failed" and f"{names[-1]} (erased: learned from" in reason, reason


def erased_rows(served: Running) -> dict[str, Any]:
    """Every erased adapter version, by name, with its content address and why."""
    with served.server.pool.connection() as conn:
        rows = conn.execute(
            "SELECT a.specialist || '@' || a.version AS name, a.sha256, e.reason "
            "FROM adapter_versions a JOIN adapter_erasures e USING (adapter_version_id)"
        ).fetchall()
    return {r["name"]: r for r in rows}


def erased_of(served: Running, tenant: str) -> list[str]:
    with served.server.pool.connection() as conn:
        return sorted(exposure(conn, served.server.log, [tenant]).erased)


def is_turn(payload: object) -> bool:
    return isinstance(payload, TurnReceived)


def exposure_of(served: Running, tenant: str) -> tuple[list[str], bool]:
    """The adapters that learned from ``tenant``, and whether the active release serves one."""
    with served.server.pool.connection() as conn:
        found = exposure(conn, served.server.log, [tenant])
    return sorted(found.adapters), found.active


def assert_unlearned(served: Running, promoted: ReleasePromoted, log_path: Path) -> None:
    """genui@2 (a child of genui@0) serves; it trained on the bystander's records alone, was
    judged against the release with genui@0 in place, and its promotion names the forgetting.
    The learner's secret is in no table, no file under the home (adapters, snapshots, logs) and
    not in the worker's log."""
    assert promoted.run_id is not None
    with served.server.pool.connection() as conn:
        release = active_release(conn)
        detail = run_detail(conn, promoted.run_id)
        row = conn.execute(
            "SELECT p.reason, e.scores ->> 'parent_release_id' AS judged_against "
            "FROM promotions p JOIN evaluations e USING (run_id) "
            "WHERE p.to_release_id = %s AND p.kind = 'promoted'",
            (promoted.release_id,),
        ).fetchone()
        fallback = conn.execute(
            "SELECT ra.adapter_version_id FROM release_adapters ra "
            "WHERE ra.release_id = %s AND ra.specialist = 'genui'",
            (row["judged_against"] if row else None,),
        ).fetchone()
    assert release.release_id == promoted.release_id
    genui = release.adapters["genui"]
    assert genui.name == "genui@2"
    assert row is not None and "unlearns 1 forgotten tenant(s)" in row["reason"]
    assert fallback is not None and row["judged_against"] != promoted.parent_release_id
    with served.server.pool.connection() as conn:
        parent = conn.execute(
            "SELECT parent_id FROM adapter_versions WHERE adapter_version_id = %s",
            (genui.adapter_version_id,),
        ).fetchone()
    assert parent is not None and parent["parent_id"] == fallback["adapter_version_id"]  # genui@0
    snapshot = detail["snapshot"]
    assert isinstance(snapshot, dict) and snapshot["forgotten_tenants_left_out"] == 1
    [retrained] = [
        e.payload
        for e in served.events()
        if isinstance(e.payload, CandidateTrained) and e.payload.run_id == promoted.run_id
    ]
    assert retrained.metrics["tenants"] == 1  # the bystander
    assert exposure_of(served, "learner") == (["genui@1"], False)
    assert exposure_of(served, "bystander") == (["genui@1", "genui@2"], True)
    files = [log_path, *(p for p in served.settings.home.rglob("*") if p.is_file())]
    assert len(files) > 3  # the adapters, their snapshots' files and logs are there to search
    assert not [path for path in files if SECRET.encode() in path.read_bytes()]
    assert SECRET not in database_text(served)
    assert served.settings.redis_url is not None
    assert SECRET not in redis_text(served.settings.redis_url)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_text(url: str) -> str:
    """Every key of the Redis database with its value, whatever its type (Celery's queues,
    results and bindings, the rate limits' windows), as text."""
    client = redis.Redis.from_url(url, decode_responses=False)
    read: dict[str, Callable[[Any], object]] = {
        "string": client.get,
        "list": lambda key: client.lrange(key, 0, -1),
        "hash": client.hgetall,
        "set": client.smembers,
        "zset": lambda key: client.zrange(key, 0, -1),
        "none": lambda _key: None,  # gone between the scan and the read (a rate window expired)
    }
    found = [repr((key, read[_text(client.type(key))](key))) for key in client.scan_iter()]
    assert found  # Celery's bindings at least
    return "\n".join(found)
