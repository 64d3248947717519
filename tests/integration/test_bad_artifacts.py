"""Bad stored input: an adapter whose files were changed or that lies outside the artifact store,
and a poison event in the log. Each is refused with a clear error and costs nothing else."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from core.errors import AdapterInvalid
from core.settings import Settings
from engines.instant import InstantEngine, fixed_reply
from infra.artifacts import ArtifactStore, folder_digest
from infra.identity_adapter import write_identity_adapter
from infra.postgres.db import open_pool
from infra.postgres.erasure import (
    erased_adapters,
    erased_digests,
    erased_lines,
    record_erasures,
)
from server.erasure import remove_erased
from server.router import RouterService
from streams.host import ProcessorHost
from streams.projections import Projections
from streams.runner import catch_up
from tests.factories import inject_postgres, raw_envelope
from tests.serving import Running, frames_until, running_server, send

pytestmark = pytest.mark.badinput


def test_a_changed_or_misplaced_adapter_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "adapters")
    draft = tmp_path / "draft"
    write_identity_adapter(tiny_model, draft, base_model=tiny_model.name, rank=4, seed=1)
    sha, stored = store.put(draft)
    assert store.verified_path(sha, str(stored)) == stored.resolve()

    outside = tmp_path / "elsewhere" / sha  # the same files, outside the store
    shutil.copytree(stored, outside)
    other = tmp_path / "other"  # a link in the store that leads out of it
    write_identity_adapter(tiny_model, other, base_model=tiny_model.name, rank=4, seed=2)
    other_sha = folder_digest(other)
    (store.root / other_sha).symlink_to(other, target_is_directory=True)
    refused = [
        (sha, str(outside)),
        (sha, str(stored / ".." / ".." / "elsewhere" / sha)),
        (sha, "/etc"),
        (other_sha, str(store.root / other_sha)),
    ]
    for digest, path in refused:
        with pytest.raises(AdapterInvalid, match=r"is not \S+ in the artifact store"):
            store.verified_path(digest, path)

    weights = stored / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte changed
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterInvalid, match="is corrupted") as caught:
        store.verified_path(sha, str(stored))
    assert caught.value.code == "adapter_invalid"


@pytest.fixture
def served_on(
    database_url: str, tiny_model: Path, router: RouterService, tmp_path: Path
) -> Iterator[Running]:
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        turns_per_minute=1000,
    )
    with running_server(settings, engine=InstantEngine(fixed_reply("ok")), router=router) as run:
        yield run


def test_a_poison_event_goes_to_the_dead_letters_and_the_processor_goes_on(
    database_url: str, served_on: Running
) -> None:
    log = served_on.server.log  # opens the server's sealed events
    host = ProcessorHost(Projections(), log, served_on.server.pool)
    key = served_on.key("acme")
    turns = []
    for n in range(2):
        with served_on.connect(key) as ws:
            frames_until(ws, "ready")
            send(ws, type="user_turn", client_msg_id=f"p{n}", content="hello")
            turns.append(frames_until(ws, "turn_completed")[-1]["turn_id"])
        if n == 0:  # between the two turns: a TurnReceived this code cannot read
            inject_postgres(
                database_url,
                raw_envelope(
                    key=f"poison-{uuid.uuid4()}",
                    type="TurnReceived",
                    schema_version=3,
                    payload={"turn_id": "not a uuid"},
                ),
            )
    handled = catch_up(host)
    [letter] = log.dead_letters()
    assert letter.code == "invalid_event" and "TurnReceived" in letter.reason
    with served_on.server.pool.connection() as conn:
        projected = {str(r["turn_id"]) for r in conn.execute("SELECT turn_id FROM turns")}
    assert set(turns) <= projected  # the turn after the poison was handled too
    assert handled > 0 and host.lag() == 0
    log.close()


def test_erased_weights_leave_the_store_once_nothing_may_read_them(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """``adapter_erasures`` says which versions are erased. Their folders leave the store, but
    one a version not erased shares, one loaded here and one leased in the fleet (until they
    are not); what a removal killed half-way left goes too. A version trained from an erased
    one is refused as the erased one is."""
    store = ArtifactStore(tmp_path / "adapters")
    digests = []
    for seed in (1, 2):
        draft = tmp_path / f"draft-{seed}"
        write_identity_adapter(tiny_model, draft, base_model=tiny_model.name, rank=4, seed=seed)
        digests.append(store.put(draft)[0])
    shared, alone = digests
    why = "learned from a forgotten tenant"
    with open_pool(database_url) as pool, pool.connection() as conn:
        conn.execute("INSERT INTO specialists (name) VALUES ('legal')")
        ids: list[int] = []
        for version, digest in enumerate([shared, shared, alone, shared]):
            row = conn.execute(
                "INSERT INTO adapter_versions (specialist, version, parent_id, sha256, path, "
                "rank, base_model) VALUES ('legal', %s, %s, %s, %s, 4, 'tiny') "
                "RETURNING adapter_version_id",
                (version, ids[-1] if ids else None, digest, str(store.root / digest)),
            ).fetchone()
            assert row is not None
            ids.append(int(row["adapter_version_id"]))
        assert record_erasures(conn, ids[1:3], why) == 2  # legal@1 and legal@2
        assert record_erasures(conn, ids[1:3], "again") == 0  # said once
        assert erased_adapters(conn) == {i: why for i in ids[1:3]}
        assert erased_digests(conn) == {alone: ["legal@2"]}  # legal@0 shares legal@1's
        assert erased_lines(conn, [ids[0], ids[3]]) == {
            "legal@3": f"trained from legal@2, erased: {why}"
        }
        assert erased_lines(conn, [ids[1]]) == {"legal@1": f"erased: {why}"}

        assert remove_erased(conn, store, busy=["legal@2"]) == 1  # loaded here
        conn.execute(
            "INSERT INTO adapter_leases (adapter, holder, expires_at) "
            "VALUES ('legal@2', 'another-server', now() + interval '1 minute')"
        )
        assert remove_erased(conn, store, busy=[]) == 1  # leased in the fleet
        assert (store.root / alone).is_dir()
        conn.execute("DELETE FROM adapter_leases")
        half = store.root / ".erasing-killed" / alone  # a removal cut short
        shutil.copytree(store.root / alone, half)
        assert remove_erased(conn, store, busy=[]) == 0
        assert not (store.root / alone).exists() and (store.root / shared).is_dir()
        assert [p.name for p in store.root.iterdir()] == [shared]
        assert not store.remove(alone)  # gone already
        with pytest.raises(psycopg.errors.CheckViolation):
            record_erasures(conn, ids[:1], "")
