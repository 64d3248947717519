"""Forgetting a tenant on a real server, PostgreSQL log and stream processors: two tenants chat
(with an edit, an agent turn and a GenUI turn) over the WebSocket; one is forgotten through the
admin API. No table, and no raw file of PostgreSQL (data, dead tuples, write-ahead log), Redis or
the homes, ever held their words in plaintext (the log and the experience builder's join state
seal them); the forgotten tenant's rows are gone and no longer open, the chain and the audit
verify, a clean replay of the processors gives the live tables, and the other tenant's data is
untouched."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from core.errors import MasterKeyInvalid, TenantForgotten
from core.events import ModelResponded, TurnReceived
from core.events.chain import verify_chain
from core.events.privacy import Cells, Forgotten
from core.experience import experience_key
from core.registry import DatasetSnapshot, QueuedRun, RunOutput
from core.settings import Settings
from engines.instant import InstantEngine
from infra.identity_adapter import write_identity_adapter
from infra.local_stack import LocalStack
from infra.master_key import new_master_key_line
from infra.postgres.db import Pool
from infra.postgres.experience_joins import joined_turn
from infra.postgres.exposure import forgotten_tenants
from infra.postgres.keys import create_key
from infra.postgres.lineage import audit
from infra.postgres.registry import activate_release
from infra.postgres.replay import tables_hash
from infra.postgres.runs import (
    dataset_snapshot,
    finish_run,
    queue_run,
    record_snapshot,
)
from learners.runtime import SnapshotForgotten
from learners.training.snapshots import materialize
from macaron import wiring
from server.entrypoints.app import status_of
from server.exposure import exposure
from server.forgetting import forget_tenant
from server.router import RouterService
from server.unlearning import ForgettingRaced, queue_retraining
from streams.backfill import BackfillRequest, backfill
from streams.replay import replay
from streams.runner import catch_up
from streams.trigger import train_now
from tests.factories import run_macaron
from tests.integration.test_harness import script
from tests.serving import Running, frames_until, send, serving, successor

SECRETS = {tenant: f"{tenant}-secret-{uuid.uuid4().hex[:12]}" for tenant in ("acme", "globex")}


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
        engine=InstantEngine(script),
        router=router,
        model_dir=tiny_model,
        turns_per_minute=1000,
    ) as running:
        for tenant, secret in SECRETS.items():
            with running.connect(running.key(tenant)) as ws:
                frames_until(ws, "ready")
                for content, hint, feedback in [
                    (f"hello {secret}", None, {"kind": "edit", "edited_text": f"hi {secret}"}),
                    (f"remember {secret} and compute", "agent", {"kind": "up"}),
                    (f"show me a card about {secret}", "genui", None),
                ]:
                    frame: dict[str, Any] = {"client_msg_id": str(uuid.uuid4()), "content": content}
                    if hint:
                        frame["specialist_hint"] = hint
                    send(ws, type="user_turn", **frame)
                    turn_id = frames_until(ws, "turn_completed")[-1]["turn_id"]
                    if feedback:
                        send(ws, type="feedback", turn_id=turn_id, **feedback)
                send(ws, type="ping")
                frames_until(ws, "pong")
        yield running


def database_text(served: Running) -> str:
    """Every row of every table in the database, as text: the raw bytes a dump would hold."""
    with served.server.pool.connection() as conn:
        tables = [
            r["table_name"]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchall()
        ]
        return "\n".join(
            str(row["row"])
            for table in tables
            for row in conn.execute(f'SELECT row_to_json(t)::text AS row FROM "{table}" t')
        )


def join_state_words(served: Running, tenant: str) -> int:
    """How many of the tenant's turns the experience builder's join state holds, each checked
    to open with the tenant's secret in it (the cells are sealed: no table shows it)."""
    cells = Cells(served.server.app.state.data_keys)
    with served.server.pool.connection() as conn:
        rows = conn.execute(
            "SELECT turn_id FROM experience_turns WHERE tenant_id = %s", (tenant,)
        ).fetchall()
        joined = [joined_turn(conn, cells, row["turn_id"], 8) for row in rows]
    assert all(turn is not None and SECRETS[tenant] in turn.content for turn in joined)
    return len(joined)


def words_in_files(roots: list[Path], words: Iterable[str], server: wiring.Server) -> set[str]:
    """Which of ``words`` the raw bytes of the files under ``roots`` hold, after a checkpoint
    has written every page PostgreSQL holds in memory: its data files, dead tuples and
    write-ahead log, Redis's files, the logs, the artifacts."""
    with server.pool.connection() as conn:
        conn.execute("CHECKPOINT")
    found = set()
    for path in (path for root in roots for path in root.rglob("*")):
        try:
            data = path.read_bytes() if path.is_file() else b""
        except FileNotFoundError:  # a server's temporary file, gone meanwhile
            continue
        found |= {word for word in words if word.encode() in data}
    return found


def admin(served: Running) -> dict[str, str]:
    return {"Authorization": f"Bearer {served.key('ops', 'admin')}"}


def test_a_forgotten_tenant_leaves_no_words_and_the_rest_verifies(
    served: Running, stack: LocalStack
) -> None:
    server = served.server
    hosts = wiring.processor_hosts(served.settings, server.log, server.pool)
    for _ in range(2):  # a second pass takes the derived events
        for host in hosts:
            catch_up(host)
    # No table holds a word of theirs in plaintext: the log and the join state seal them, the
    # turns projection keeps none.
    assert not any(secret in database_text(served) for secret in SECRETS.values())
    assert join_state_words(served, "globex") == join_state_words(served, "acme") == 3

    answer = httpx.delete(f"{served.http}/admin/tenants/acme", headers=admin(served))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["forgotten"] is True and body["already"] is False
    assert body["keys_revoked"] == 1 and body["rows_erased"]["turns"] == 3
    assert body["rows_erased"]["score_turns"] == 3
    for host in hosts:
        catch_up(host)

    assert join_state_words(served, "acme") == 0
    assert join_state_words(served, "globex") == 3  # still opens
    canary = f"canary-{uuid.uuid4().hex}"  # plaintext written as the rows were: it is found
    with server.pool.connection() as conn:
        conn.execute("CREATE TABLE canary (words TEXT)")
        conn.execute("INSERT INTO canary VALUES (%s)", (canary,))
    roots = [stack.home, served.settings.home]
    assert words_in_files(roots, [canary, *SECRETS.values()], server) == {canary}
    assert verify_chain(server.log.envelopes()) == []
    with server.pool.connection() as conn:
        assert audit(conn, server.log, server.app.state.store).ok
    events = list(server.log.read())
    acme = [e for e in events if e.envelope.tenant_id == "acme"]
    assert acme and all(isinstance(e.payload, Forgotten) for e in acme)
    globex_words = [
        e.payload.content if isinstance(e.payload, TurnReceived) else e.payload.text
        for e in events
        if e.envelope.tenant_id == "globex" and isinstance(e.payload, TurnReceived | ModelResponded)
    ]
    assert len(globex_words) == 6 and any(SECRETS["globex"] in w for w in globex_words)

    for host in hosts:
        if host.processor.name in ("projections-1", "experience", "live-scores-2"):
            rebuilt = replay(host.processor, server.log, server.pool)
            assert rebuilt.forgotten == len(acme), host.processor.name  # skipped and counted
            with server.pool.connection() as conn:
                live = tables_hash(conn, host.processor.tables)
            assert rebuilt.digest == live, host.processor.name
    again = backfill(
        server.log, server.pool, server.app.state.data_keys, BackfillRequest("experience-1")
    )  # derives globex's turns only
    assert again.forgotten == len(acme) and again.records > 0
    assert_pending_records_left_acme_out(served)


def assert_pending_records_left_acme_out(served: Running) -> None:
    """Both tenants' agent records were pending when acme was forgotten: the trigger counted
    them again, so the snapshot ``macaron train`` takes now leaves acme out and opens with
    globex's records (rolled back: the next test trains the agent)."""
    server = served.server
    version = served.settings.experience_filter
    with server.pool.connection() as conn, conn.transaction() as tx:
        request = train_now(conn, "agent", version)
        snapshot = dataset_snapshot(conn, request.snapshot.snapshot_id)
        raise_rollback = psycopg.Rollback(tx)
        assert snapshot is not None and snapshot.left_out_tenants == ("acme",)
        opened = materialize(server.log, snapshot)
        teaching = [r for r in opened.records if r.kind != "trajectory"]  # rewards ride along
        assert opened.tenants == 1 and len(teaching) == snapshot.record_count > 0
        raise raise_rollback


def test_forgetting_is_idempotent_and_typed(served: Running) -> None:
    server = served.server
    keys = wiring.data_keys(served.settings, server.pool)
    forget_tenant(server.pool, server.log, keys, "acme")
    again = forget_tenant(server.pool, server.log, keys, "acme")
    assert again.already is True and again.keys_revoked == 0
    forgotten_events = [e for e in server.log.read() if e.envelope.type == "TenantForgotten"]
    assert len(forgotten_events) == 1  # the event happens once

    shown = httpx.get(f"{served.http}/admin/exposure", headers=admin(served)).json()
    assert shown["forgotten_tenants"] == 1 and shown["records"] > 0  # acme's edit taught
    assert shown["adapters"] == [] and shown["releases"] == []  # but no run trained on it
    unknown = httpx.delete(f"{served.http}/admin/tenants/nobody", headers=admin(served))
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "tenant_not_found"
    no_admin = httpx.delete(
        f"{served.http}/admin/tenants/globex",
        headers={"Authorization": f"Bearer {served.key('globex')}"},
    )
    assert no_admin.status_code == 403
    unclear = httpx.delete(
        f"{served.http}/admin/tenants/globex?retrain=maybe&now=1", headers=admin(served)
    )
    problems = unclear.json()["error"]["message"]
    assert unclear.status_code == 400 and "retrain:" in problems and "now:" in problems
    with server.pool.connection() as conn:
        assert forgotten_tenants(conn) == ["acme"]  # refused before anything was done
    nothing_exposed = httpx.delete(
        f"{served.http}/admin/tenants/acme?retrain=true", headers=admin(served)
    )
    assert nothing_exposed.status_code == 200, nothing_exposed.text
    assert nothing_exposed.json()["retraining"] == {
        "runs": [],
        "router_run": None,
        "fallback_release_id": None,
        "restored": [],
        "fallback_pending": None,
    }
    with server.pool.connection() as conn, pytest.raises(TenantForgotten):
        create_key(conn, "acme", {"chat"})

    env = {
        "MACARON_DATABASE_URL": served.settings.database_url or "",
        "MACARON_HOME": str(served.settings.home),
    }
    cli = run_macaron("tenants", "forget", "acme", "--yes", **env)
    assert cli.returncode == 0 and "already forgotten" in cli.stdout, cli.stderr
    shown = run_macaron("tenants", "exposure", **env)
    assert shown.returncode == 0 and "1 forgotten tenant(s)" in shown.stdout, shown.stderr
    missing = run_macaron("tenants", "forget", "nobody", "--yes", **env)
    assert missing.returncode != 0 and "[tenant_not_found]" in missing.stderr


def test_a_master_key_that_did_not_wrap_the_keys_refuses_start_up_and_rotation_rewraps(
    pool: Pool, tmp_path: Path
) -> None:
    first, second = tmp_path / "first.key", tmp_path / "second.key"
    first.write_text(new_master_key_line("one"))
    second.write_text(new_master_key_line("two"))
    keys = wiring.data_keys(Settings(home=tmp_path, master_key_file=first), pool)
    made = keys.writing_key("acme")
    with pytest.raises(MasterKeyInvalid) as refused:
        wiring.event_log(Settings(home=tmp_path, master_key_file=second), pool)
    assert refused.value.code == "master_key_invalid"
    elsewhere = tmp_path / "another-home"  # no key file there: none is made, it could not open
    with pytest.raises(MasterKeyInvalid, match="no master key file"):
        wiring.data_keys(Settings(home=elsewhere), pool)
    assert not (elsewhere / "master.key").exists()

    both = tmp_path / "both.key"  # the new key first, the old one kept until the rewrap
    both.write_text(second.read_text() + first.read_text())
    rotating = wiring.data_keys(Settings(home=tmp_path, master_key_file=both), pool)
    rotating.writing_key("globex")  # wrapped by "two" while acme's key is still by "one"
    with pytest.raises(MasterKeyInvalid, match="'one'"):  # every wrapping master is checked
        wiring.data_keys(Settings(home=tmp_path, master_key_file=second), pool)
    assert rotating.rewrap() == 1
    rotated = wiring.data_keys(Settings(home=tmp_path, master_key_file=second), pool)
    assert rotated.reading_key("acme", made.key_id) == made


def test_retraining_starts_before_the_exposure_and_leaves_the_tenant_out(
    served: Running, tiny_model: Path, tmp_path: Path
) -> None:
    """An adapter trained on both tenants' agent records is active; once acme is forgotten,
    ``--retrain`` queues a successor of agent@0 on the same range whose snapshot opens without
    acme's records (and the old snapshot never opens again); asked with a list of forgotten
    tenants read before acme's forget, it is ``forgetting_raced`` (409), to be asked again."""
    server = served.server
    hosts = wiring.processor_hosts(served.settings, server.log, server.pool)
    for host in hosts:
        catch_up(host)
    keys = server.app.state.data_keys  # the server's own: its log stops opening acme at once
    forget_tenant(server.pool, server.log, keys, "acme")  # already, after the tests above
    records = list(server.log.read(key=experience_key("agent")))
    kept = [e for e in records if e.envelope.tenant_id == "globex"]
    assert kept and any(e.envelope.tenant_id == "acme" for e in records)
    version = kept[0].payload.filter_version  # type: ignore[attr-defined]
    offsets = [e.position.offset for e in records]
    trained_on = DatasetSnapshot(
        snapshot_id=uuid.uuid4(),
        specialist="agent",
        partition=0,
        start_offset=min(offsets),
        end_offset=max(offsets) + 1,
        filter_version=version,
        content_hash="0" * 64,  # as made before acme was forgotten; never opened here
        record_count=len(records),
    )
    write_identity_adapter(
        tiny_model, tmp_path / "agent", base_model=tiny_model.name, rank=4, seed=1
    )
    child = successor(served, tmp_path / "agent", 4, "agent")
    run_id = uuid.uuid4()
    with server.pool.connection() as conn, conn.transaction():
        record_snapshot(conn, trained_on)
        made = child.adapters["agent"]
        queue_run(
            conn,
            QueuedRun(
                run_id=run_id,
                specialist="agent",
                parent_adapter_id=made.adapter_version_id,
                snapshot_id=trained_on.snapshot_id,
                kind="adapter",
                recipe="lora",
            ),
        )
        finish_run(
            conn,
            run_id,
            RunOutput(adapter_version_id=made.adapter_version_id, config={}, metrics={}),
        )
        activate_release(conn, child.release_id, "test")
        assert not exposure(conn, server.log, ["acme"]).active  # queued after: acme unreadable
        conn.execute(  # as if queued before acme was forgotten
            "UPDATE training_runs SET created_at = created_at - interval '1 day' WHERE run_id = %s",
            (run_id,),
        )
        assert exposure(conn, server.log, ["acme"]).active

    with server.pool.connection() as conn, conn.transaction():
        # a list of forgotten tenants read before acme's forget (here naming globex as if it
        # had been forgotten first) lacks acme: the retraining finds acme's records unreadable
        # and says another tenant was forgotten meanwhile; its transaction queues nothing
        with pytest.raises(ForgettingRaced) as raced:
            queue_retraining(conn, server.log, ["globex"])
        assert raced.value.code == "forgetting_raced" and raced.value.retryable
        assert status_of(raced.value) == 409  # not 410: the request's own tenant is not gone
    with server.pool.connection() as conn, conn.transaction():
        unlearning = queue_retraining(conn, server.log, ["acme"])
    [queued] = unlearning.runs
    assert queued.specialist == "agent" and queued.parent == "agent@0"
    assert unlearning.fallback is None  # globex's records are left to learn from
    with server.pool.connection() as conn:
        again = queue_retraining(conn, server.log, ["acme"]).runs  # the same run, queued once
        snapshot = dataset_snapshot(conn, queued.event.payload.snapshot_id)  # type: ignore[attr-defined]
        old = dataset_snapshot(conn, trained_on.snapshot_id)
    assert [r.run_id for r in again] == [queued.run_id]
    assert snapshot is not None and snapshot.left_out_tenants == ("acme",)
    replayed = materialize(server.log, snapshot)
    assert (
        len(replayed.records)
        == queued.records
        == len(
            [e for e in kept if e.payload.filter_version == version]  # type: ignore[attr-defined]
        )
    )
    assert replayed.tenants == 1
    assert old is not None
    with pytest.raises(SnapshotForgotten):
        materialize(server.log, old)
