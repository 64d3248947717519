"""Specialists at run time, with a real server, PostgreSQL and the real embedding model, through
the command line as an operator runs it: ``macaron specialist add`` files a release that the
running server promotes; the new specialist is offered (``ready``, ``/v1/models``), turns like
its examples go to it, on its own adapter and harness entry; ``disable`` and ``enable`` take it
out of the router and back; every bad input is a typed error that changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from core.events import RouterDecided, SpecialistAdded
from core.settings import Settings
from macaron import wiring
from server.router import SentenceEmbedder
from tests.factories import run_macaron
from tests.integration.test_router import LEGAL_EXAMPLES, LEGAL_PROBES
from tests.serving import Running, frames_until, running_server, send

DESCRIPTION = "Questions about the law, contracts and your rights."


def ready_and_models(served: Running, key: str) -> tuple[list[str], list[str]]:
    with served.connect(key) as ws:
        [ready] = frames_until(ws, "ready")
    models = httpx.get(
        f"{served.http}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).json()["data"]
    return ready["specialists"], [m["id"] for m in models]


def routed(served: Running, key: str, text: str, hint: str | None = None) -> dict[str, Any]:
    """The ``turn_started`` frame of one turn (which runs to its end)."""
    with served.connect(key) as ws:
        frames_until(ws, "ready")
        extra = {} if hint is None else {"specialist_hint": hint}
        send(ws, type="user_turn", client_msg_id="m1", content=text, **extra)
        frames = frames_until(ws, "turn_completed")
    [started] = [f for f in frames if f["type"] == "turn_started"]
    return started


def releases(served: Running) -> int:
    with served.server.pool.connection() as conn:
        row = conn.execute("SELECT count(*) AS n FROM releases").fetchone()
    assert row is not None
    return int(row["n"])


def test_a_specialist_added_at_run_time_is_served_routed_disabled_and_enabled(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        turns_per_minute=1000,
        max_new_tokens=8,
    )
    env = {
        "MACARON_HOME": str(settings.home),
        "MACARON_DATABASE_URL": database_url,
        "MACARON_MODEL_DIR": str(tiny_model),
    }
    examples = tmp_path / "legal.jsonl"
    examples.write_text("".join(json.dumps({"text": t}) + "\n" for t in LEGAL_EXAMPLES))
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": t}) + "\n" for t in LEGAL_EXAMPLES[:3]))
    not_jsonl = tmp_path / "legal.txt"
    not_jsonl.write_text("\n".join(LEGAL_EXAMPLES))
    own = wiring.seed_router(SentenceEmbedder())  # the test's server swaps its classifier
    with running_server(settings, router=own) as served:
        key = served.key("legal-user")
        before, count = served.server.chat.release, releases(served)
        add = ["specialist", "add", "legal", "--description", DESCRIPTION, "--examples"]
        for args, code in [
            ([*add[:2], "Legal!", *add[3:], str(examples)], "invalid_specialist_name"),
            ([*add[:2], "coding", *add[3:], str(examples)], "specialist_exists"),
            ([*add, str(few)], "insufficient_training_data"),
            ([*add, str(not_jsonl)], "examples_invalid"),
            ([*add, str(tmp_path / "missing.jsonl")], "examples_invalid"),
            ([*add[:4], " ", "--examples", str(examples)], "config_invalid"),
            (["specialist", "disable", "chat"], "specialist_required"),
            (["specialist", "disable", "astrology"], "unknown_specialist"),
            (["specialist", "enable", "coding"], "specialist_exists"),
        ]:
            refused = run_macaron(*args, **env)
            status = 2 if code == "config_invalid" else 1  # an argument: as a usage error
            assert refused.returncode == status and code in refused.stderr, (args, refused.stderr)
        assert served.server.chat.release == before and releases(served) == count
        assert not [e for e in served.events() if isinstance(e.payload, SpecialistAdded)]

        done = run_macaron(*add, str(examples), "--timeout", "120", **env)
        assert done.returncode == 0, done.stderr
        release = served.server.chat.release
        assert release.parent_release_id == before.release_id
        assert release.adapters["legal"].name == "legal@0"
        assert DESCRIPTION in served.server.chat.harness.spec.specialists["legal"].system_prompt
        offered, models = ready_and_models(served, key)
        assert offered[-1] == "legal" and "legal" in models
        [added] = [e.payload for e in served.events() if isinstance(e.payload, SpecialistAdded)]
        assert added.examples == LEGAL_EXAMPLES and added.description == DESCRIPTION
        for probe in LEGAL_PROBES[:3]:
            started = routed(served, key, probe)
            assert (started["specialist"], started["adapter_version"]) == ("legal", "legal@0")
        decided = [e.payload for e in served.events() if isinstance(e.payload, RouterDecided)]
        assert all("legal" in d.scores for d in decided)
        listed = run_macaron("specialist", "list", **env)
        assert listed.returncode == 0 and "10 examples" in listed.stdout, listed.stderr
        added_router = release.router_version

        assert run_macaron("specialist", "disable", "legal", **env).returncode == 0
        offered, models = ready_and_models(served, key)
        assert "legal" not in offered and "legal" not in models
        assert routed(served, key, LEGAL_PROBES[0], hint="legal")["specialist"] != "legal"
        assert "legal" in served.server.chat.release.adapters  # kept, unused

        assert run_macaron("specialist", "enable", "legal", **env).returncode == 0
        assert served.server.chat.release.router_version == added_router  # the same fit
        assert routed(served, key, LEGAL_PROBES[1])["specialist"] == "legal"
