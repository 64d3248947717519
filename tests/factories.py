"""Event and release builders shared by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Json

from core.canonical import canonical_json, sha256_hex
from core.events import NewEvent, TurnReceived, chain_hash, format_time, utc_now
from core.ids import uuid7
from core.release import AdapterRef, Release
from infra.master_key import parse_master_keys
from infra.postgres.data_keys import PostgresDataKeys
from infra.postgres.db import Pool


def turn(key: str, n: int = 0, *, tenant: str = "tenant-a", **kw: Any) -> NewEvent:
    payload = TurnReceived(
        conversation_id=uuid.uuid5(uuid.NAMESPACE_URL, key),
        turn_id=uuid.uuid4(),
        client_msg_id=f"msg-{n}",
        content=f"message {n} on {key}",
        release_id=None,
        harness=None,
    )
    return NewEvent(payload=payload, tenant_id=tenant, key=key, **kw)


def raw_envelope(
    *,
    key: str,
    type: str,
    schema_version: int,
    payload: dict[str, Any],
    sequence: int = 1,
    prev_hash: str | None = None,
) -> dict[str, Any]:
    """A correctly hashed envelope as JSON, for any type or version (as a newer writer might
    store one)."""
    header = {
        "event_id": str(uuid7()),
        "type": type,
        "schema_version": schema_version,
        "occurred_at": format_time(utc_now()),
        "tenant_id": "tenant-a",
        "key": key,
        "sequence": sequence,
        "causation_id": None,
        "correlation_id": None,
        "trace": {},
        "prev_hash": prev_hash,
    }
    digest = sha256_hex(canonical_json(payload))
    return {**header, "hash": chain_hash(header, digest), "payload": payload}


def root_release(*specialists: str) -> Release:
    """A root release serving a version-0 adapter (placeholder weights) per specialist."""
    refs = {
        name: AdapterRef(
            adapter_version_id=i, specialist=name, version=0, sha256="0" * 64, path="p", rank=4
        )
        for i, name in enumerate(specialists)
    }
    return Release(
        release_id="r0",
        parent_release_id=None,
        base_model="tiny",
        router_version="router-seed",
        harness_version="harness@0",
        hcp_version="hcp-1",
        adapters=refs,
    )


def make_adapter(base_dir: Path, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter with random A and B (so it changes the output), saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=4 * rank,
        target_modules=targets,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    get_peft_model(base, config).save_pretrained(str(out))
    return out


def run_macaron(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The ``macaron`` command as an operator runs it, with only the given MACARON_ settings."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MACARON_")}
    environ.update({"COLUMNS": "200", **env})
    return subprocess.run(
        [sys.executable, "-m", "macaron", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=900,
    )


def inject_postgres(database_url: str, envelope: dict[str, Any]) -> None:
    """Store an envelope in the PostgreSQL log as it is, bypassing the writer's checks (as a
    writer of another code version might have stored it)."""
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO events (event_id, type, schema_version, occurred_at, tenant_id, key, "
            "sequence, causation_id, correlation_id, trace, prev_hash, hash, payload) VALUES "
            "(%s, %s, %s, %s, %s, %s, %s, NULL, NULL, %s, %s, %s, %s)",
            (
                envelope["event_id"],
                envelope["type"],
                envelope["schema_version"],
                envelope["occurred_at"],
                envelope["tenant_id"],
                envelope["key"],
                envelope["sequence"],
                Json(envelope["trace"]),
                envelope["prev_hash"],
                envelope["hash"],
                Json(envelope["payload"]),
            ),
        )


TEST_MASTER_KEYS = "tests " + "bWFjYXJvbi10ZXN0cy1tYXN0ZXIta2V5LTMyLWJ5dGU=\n"
"""A fixed master key (32 bytes) for logs the tests build by hand."""


def data_keys_for(pool: Pool) -> PostgresDataKeys:
    """Data keys in the test's database, wrapped by ``TEST_MASTER_KEYS``."""
    return PostgresDataKeys(pool, parse_master_keys(TEST_MASTER_KEYS, "tests"))
