"""Security by default, against a real server: tenants see only their own data over every API,
admin actions need an admin key, keys are stored hashed, no secret reaches an event, a log line
or a span, and rate limits hold."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core.settings import Settings
from infra.local_stack import LocalStack
from server.router import RouterService
from tests.conftest import fresh_database
from tests.serving import Running, following, frames_until, running_server, send, serving

pytestmark = pytest.mark.security

TURNS_PER_MINUTE = 3


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    with serving(
        stack,
        tmp_path_factory,
        router=router,
        model_dir=tiny_model,
        max_new_tokens=8,
        turns_per_minute=TURNS_PER_MINUTE,
    ) as running:
        yield running


def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def a_turn(served: Running, key: str, content: str = "hello") -> dict[str, str]:
    """One completed turn: its conversation and turn ids (from turn_started)."""
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="m1", content=content, specialist_hint="genui")
        frames = frames_until(ws, "turn_completed")
    started = frames[0]
    return {"conversation_id": started["conversation_id"], "turn_id": started["turn_id"]}


def test_no_api_reaches_another_tenants_conversation(served: Running) -> None:
    alice, mallory = served.key(tenant()), served.key(tenant())
    owned = a_turn(served, alice, "alice's secret")
    conversation_id, turn_id = owned["conversation_id"], owned["turn_id"]
    before = served.events(conversation_id)
    with served.connect(mallory) as ws:
        frames_until(ws, "ready")
        attempts = [
            {"type": "hello", "conversation_id": conversation_id},  # resume
            {
                "type": "user_turn",
                "client_msg_id": "m1",
                "content": "x",  # replay alice's id
                "conversation_id": conversation_id,
            },
            {"type": "feedback", "turn_id": turn_id, "kind": "up"},
            {"type": "feedback", "turn_id": turn_id, "kind": "regenerate"},
            {"type": "reroute", "turn_id": turn_id, "specialist": "genui"},
            {"type": "ui_event", "turn_id": turn_id, "component_id": "a", "action": "click"},
            {"type": "cancel", "turn_id": turn_id},
        ]
        for frame in attempts:
            send(ws, **frame)
            error = frames_until(ws, "error")[-1]
            assert error["code"] in {"conversation_not_found", "turn_not_found"}, (frame, error)
            assert "alice" not in json.dumps(error)
    read = httpx.get(
        f"{served.http}/v1/conversations/{conversation_id}",
        headers={"Authorization": f"Bearer {mallory}"},
    )
    assert read.status_code == 404 and read.json()["error"]["code"] == "conversation_not_found"
    assert served.events(conversation_id) == before  # nothing was written in alice's name


def test_admin_endpoints_refuse_chat_and_metrics_keys(served: Running) -> None:
    name = tenant()
    refused = {"chat": served.key(name), "metrics": served.key(name, "metrics")}
    endpoints = [
        ("GET", "/admin/scores", None),
        ("GET", "/admin/lineage/genui@0", None),
        ("GET", "/admin/releases", None),
        ("GET", "/admin/audit", None),
        ("POST", "/admin/promote", {"release_id": "rel-x"}),
        ("POST", "/admin/rollback", None),
    ]
    for scope, key in refused.items():
        for method, path, body in endpoints:
            response = httpx.request(
                method, served.http + path, json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 403, (scope, path)
            assert response.json()["error"]["code"] == "forbidden"
    for method, path, body in endpoints:  # and no key at all
        assert httpx.request(method, served.http + path, json=body).status_code == 401
    admin_only = served.key(name, "admin")
    chat = httpx.post(
        f"{served.http}/v1/chat/completions",
        headers={"Authorization": f"Bearer {admin_only}"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 403  # admin keys do not chat
    assert httpx.get(f"{served.http}/v1/models").status_code == 401


def test_a_turn_audit_shows_a_tenant_only_its_own_turns(served: Running) -> None:
    owner = tenant()
    alice, mallory = served.key(owner), served.key(tenant())
    with following(served):
        turn_id = a_turn(served, alice, "alice's secret")["turn_id"]
        url = f"{served.http}/admin/turns/{turn_id}/audit"
        deadline = time.monotonic() + 60
        own = httpx.get(url, headers={"Authorization": f"Bearer {alice}"})
        while own.status_code == 404 and time.monotonic() < deadline:  # not projected yet
            time.sleep(0.2)
            own = httpx.get(url, headers={"Authorization": f"Bearer {alice}"})
    assert own.status_code == 200, own.text
    audit = own.json()
    assert (audit["tenant_id"], audit["chain_ok"]) == (owner, True)
    assert audit["served_by"]["adapter_version"] == "genui@0"
    assert audit["training"] is None  # a root adapter: nothing taught it
    assert audit["events"][0]["type"] == "TurnReceived"
    other = httpx.get(url, headers={"Authorization": f"Bearer {mallory}"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "turn_not_found"
    assert "alice" not in other.text
    metrics = httpx.get(url, headers={"Authorization": f"Bearer {served.key(owner, 'metrics')}"})
    assert metrics.status_code == 403 and metrics.json()["error"]["code"] == "forbidden"
    assert httpx.get(url).status_code == 401
    bad = httpx.get(
        f"{served.http}/admin/turns/not-a-turn/audit",
        headers={"Authorization": f"Bearer {alice}"},
    )
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "turn_not_found"
    admin = httpx.get(url, headers={"Authorization": f"Bearer {served.key(tenant(), 'admin')}"})
    assert admin.status_code == 200 and admin.json()["turn_id"] == turn_id


def test_keys_are_stored_hashed_and_no_secret_reaches_events_logs_or_spans(
    served: Running,
    stack: LocalStack,
    spans: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    key = served.key(tenant())
    with served.connect() as ws:  # the key in a hello frame, not a header
        send(ws, type="hello", api_key=key)
        frames_until(ws, "ready")
        send(ws, type="user_turn", client_msg_id="s1", content="hello")
        frames_until(ws, "turn_completed")
    a_turn(served, key)
    httpx.post(
        f"{served.http}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    )
    secrets = [key, stack.postgres.password, stack.redis.password]

    with psycopg.connect(served.settings.database_url or "") as conn:
        stored = conn.execute("SELECT key_hash FROM api_keys").fetchall()
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            ).fetchall()
        ]
        dump = "".join(
            str(row)
            for table in tables
            for row in conn.execute(f'SELECT to_jsonb(t)::text FROM "{table}" AS t').fetchall()
        )
    assert stored and all(len(h) == 64 for (h,) in stored)
    events = json.dumps([e.envelope.to_json() for e in served.events()])
    client_side = ("websockets.client", "httpx", "httpcore")  # the test's own clients
    logs = "\n".join(
        record.getMessage() for record in caplog.records if not record.name.startswith(client_side)
    )
    traces = "\n".join(span.to_json() for span in spans.get_finished_spans())
    assert traces and events and "completed" in logs  # each turn is logged
    for secret in secrets:
        for place, text in {
            "database": dump,
            "events": events,
            "logs": logs,
            "spans": traces,
        }.items():
            assert secret not in text, place


def test_the_rate_limit_holds_per_key(served: Running) -> None:
    key = served.key(tenant())
    outcomes = []
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        for n in range(TURNS_PER_MINUTE + 2):
            send(ws, type="user_turn", client_msg_id=f"r{n}", content="hi")
            last = frames_until(ws, "turn_completed") if n < TURNS_PER_MINUTE else None
            if last is None:
                error = frames_until(ws, "error")[-1]
                outcomes.append(error["code"])
                assert error["retryable"] is True
            else:
                outcomes.append(last[-1]["type"])
    assert outcomes == ["turn_completed"] * TURNS_PER_MINUTE + ["rate_limited"] * 2
    other = served.key(tenant())  # another key is not slowed by this one
    assert a_turn(served, other)["turn_id"]


def test_two_servers_share_each_keys_rate_limit_through_redis(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two replicas on one database and one Redis: a key's limit is counted once for both (in
    memory, each would allow it in full). Another key is not slowed."""
    with fresh_database(stack) as url:
        config = Settings(
            home=tmp_path_factory.mktemp("replicas"),
            database_url=url,
            model_dir=tiny_model,
            max_new_tokens=4,
            turns_per_minute=2,
            redis_url=stack.redis.url().rsplit("/", 1)[0] + "/5",
        )
        with (
            running_server(config, router=router) as one,
            running_server(config, router=router) as two,
        ):
            key = one.key(tenant())
            assert a_turn(one, key)["turn_id"] and a_turn(two, key)["turn_id"]
            for replica in (one, two):
                with replica.connect(key) as ws:
                    frames_until(ws, "ready")
                    send(ws, type="user_turn", client_msg_id="third", content="hi")
                    error = frames_until(ws, "error")[-1]
                assert (error["code"], error["retryable"]) == ("rate_limited", True)
            assert a_turn(two, one.key(tenant()))["turn_id"]
