"""Promotion and the turns in flight: a turn keeps the release (and harness) it began with until
it ends, even when the flip comes before it reaches the engine; the old adapters go when its last
turn ends. A harness the server cannot serve is refused and the old release serves on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from core.canonical import canonical_json, sha256_hex
from core.events import RouterDecided
from core.harness.artifact import HarnessSpec, root_harness
from core.routing import RouterDecision, RouterModel
from core.settings import Settings
from engines.instant import InstantEngine
from infra.identity_adapter import write_identity_adapter
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import create_release, register_harness
from infra.postgres.routers import register_router
from macaron import wiring
from server.router import RouterService, SentenceEmbedder
from tests.serving import Running, harness_successor, running_server, successor, turn_frames


class GatedRouter:
    """The real router, made to wait at a gate: it holds a turn after the turn has taken its
    release and before it reaches the engine."""

    def __init__(self, router: RouterService) -> None:
        self.router = router
        self.entered = threading.Event()
        self.gate = threading.Event()

    def route(
        self,
        text: str,
        hint: str | None = None,
        within: Collection[str] | None = None,
        tool_callers: Collection[str] = (),
        previous: str | None = None,
    ) -> RouterDecision:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.router.route(text, hint, within, tool_callers, previous)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.router, name)


@pytest.fixture
def gated(
    database_url: str, tiny_model: Path, router: RouterService, tmp_path: Path
) -> Iterator[tuple[Running, GatedRouter]]:
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        turns_per_minute=1000,
    )
    gate = GatedRouter(router)
    engine = InstantEngine(_system_prompt)  # unloads at once: no drain of its own
    try:
        with running_server(settings, engine=engine, router=gate) as served:
            yield served, gate
    finally:
        gate.gate.set()


def _system_prompt(messages: list[dict[str, str]]) -> str:
    """The instant engine's answer: the first line of the system prompt it was given."""
    return messages[0]["content"].split("\n")[0]


def promote(served: Running, tiny_model: Path, folder: Path, specialist: str, seed: int) -> None:
    """Make a child of the active release with a new ``specialist`` adapter active."""
    write_identity_adapter(tiny_model, folder, base_model=tiny_model.name, rank=4, seed=seed)
    child = successor(served, folder, 4, specialist)
    request_id = request_promotion(served.server.pool, child.release_id, requested_by="t")
    assert wait_for_request(served.server.pool, request_id, 60).status == "done"
    wait_serving(served, child.release_id)


def wait_serving(served: Running, release_id: str) -> None:
    """A done request says the registry flipped; the server swaps a moment after."""
    deadline = time.monotonic() + 10
    while served.server.chat.release.release_id != release_id:
        assert time.monotonic() < deadline, f"{release_id} was done but not served"
        time.sleep(0.01)


@pytest.mark.parametrize("between", [False, True], ids=["one flip", "two flips"])
def test_a_turn_keeps_its_release_through_a_flip_before_it_reaches_the_engine(
    gated: tuple[Running, GatedRouter], tiny_model: Path, tmp_path: Path, between: bool
) -> None:
    """With ``between``, a release that keeps coding@0 is promoted first: the second flip
    drops coding@0, which the held turn (on the release before both) still needs."""
    served, gate = gated
    engine = served.server.engine
    with served.connect(served.key("t-held")) as ws:
        json.loads(ws.recv(timeout=30))  # ready
        ws.send(
            json.dumps(
                {"type": "user_turn", "client_msg_id": "m1", "content": "write a python function"}
            )
        )
        assert gate.entered.wait(30)  # the turn has its release and waits in the router

        if between:
            promote(served, tiny_model, tmp_path / "genui-1", "genui", seed=21)
        promote(served, tiny_model, tmp_path / "coding-1", "coding", seed=11)
        assert {"coding@0", "coding@1"} <= set(engine.loaded_adapters())  # held by the turn

        gate.gate.set()
        frames = turn_frames(ws)
        assert frames[0]["adapter_version"] == "coding@0", frames
        assert frames[-1]["type"] == "turn_completed", frames

        deadline = time.monotonic() + 10  # its end released the old version
        while "coding@0" in engine.loaded_adapters():
            assert time.monotonic() < deadline, "coding@0 was not unloaded after its last turn"
            time.sleep(0.05)
        ws.send(
            json.dumps(
                {"type": "user_turn", "client_msg_id": "m2", "content": "write a python function"}
            )
        )
        started = json.loads(ws.recv(timeout=30))
        assert started["adapter_version"] == "coding@1"


TERSE = "You are Macaron's terse coding assistant."


def _terse_coding() -> HarnessSpec:
    root = root_harness()
    coding = root.specialists["coding"].model_copy(update={"system_prompt": TERSE})
    return root.model_copy(update={"specialists": {**root.specialists, "coding": coding}})


def _stamps(served: Running, conversation_id: str) -> set[str]:
    """The harness versions a conversation's events were recorded under."""
    payloads = [e.envelope.payload for e in served.events(conversation_id)]
    return {p["harness"]["harness_version"] for p in payloads if "harness" in p}


def _ask(ws: Any, msg: str) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "user_turn", "client_msg_id": msg, "content": "write a function"}))
    return turn_frames(ws)


def test_a_harness_only_promotion_flips_at_once_and_a_held_turn_keeps_its_harness(
    gated: tuple[Running, GatedRouter],
) -> None:
    served, gate = gated
    chat = served.server.chat
    adapters = chat.release.adapters
    old_prompt = root_harness().specialists["coding"].system_prompt
    with served.connect(served.key("t-held")) as held, served.connect(served.key("t-new")) as new:
        for ws in (held, new):
            assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        held.send(
            json.dumps({"type": "user_turn", "client_msg_id": "m1", "content": "write a function"})
        )
        assert gate.entered.wait(30)  # the turn has its release and harness, and waits

        child = harness_successor(served, _terse_coding())
        request_id = request_promotion(served.server.pool, child.release_id, requested_by="t")
        assert wait_for_request(served.server.pool, request_id, 60).status == "done"
        wait_serving(served, child.release_id)
        assert chat.harness.name == "harness@1"
        assert chat.release.harness_version == "harness@1" and chat.release.adapters == adapters

        gate.gate.set()
        frames = turn_frames(held)
        assert frames[-1]["type"] == "turn_completed", frames
        answer = "".join(f["delta"] for f in frames if f["type"] == "token")
        assert answer == old_prompt
        assert _stamps(served, frames[0]["conversation_id"]) == {"harness@0"}

        after = _ask(new, "m2")
        answer = "".join(f["delta"] for f in after if f["type"] == "token")
        assert answer == TERSE and after[0]["adapter_version"] == "coding@0"
        assert _stamps(served, after[0]["conversation_id"]) == {"harness@1"}


def _enforcing_agent_with_a_broken_tool() -> dict[str, Any]:
    """The agent's grammar enforced, over a calculator whose parameters no grammar can take."""
    root = root_harness().model_dump(mode="json")
    calculator = {**root["tools"][0], "parameters": {"type": "foo"}}
    agent = {**root["specialists"]["agent"], "enforce_grammar": True}
    return {"tools": [calculator], "specialists": {**root["specialists"], "agent": agent}}


_GRAMMAR_THAT_DOES_NOT_COMPILE = _enforcing_agent_with_a_broken_tool()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"hcp_version": "hcp-2"}, "hcp-2"),
        ({"catalogue_version": "genui-9"}, "genui-9"),
        ({"tools": [{"name": "teleport", "description": "go", "parameters": {}}]}, "teleport"),
        # the instant engine enforces no grammar: it refuses every harness that enforces one
        (_GRAMMAR_THAT_DOES_NOT_COMPILE, "the instant engine"),
    ],
    ids=["newer hcp", "unknown catalogue", "unknown tool", "grammar the engine cannot enforce"],
)
def test_a_harness_the_server_cannot_serve_is_refused_and_the_old_release_serves_on(
    gated: tuple[Running, GatedRouter], change: dict[str, Any], reason: str
) -> None:
    """As a newer server might have registered it: stored with its true address."""
    served, gate = gated
    gate.gate.set()
    _assert_refused(served, change, reason)


def test_a_harness_whose_grammar_does_not_compile_is_refused_at_promotion(
    database_url: str, tiny_model: Path, router: RouterService, tmp_path: Path
) -> None:
    """On a real engine the harness's grammars are compiled before the flip."""
    settings = Settings(home=tmp_path / "home", database_url=database_url, model_dir=tiny_model)
    with running_server(settings, router=router) as served:
        _assert_refused(served, _GRAMMAR_THAT_DOES_NOT_COMPILE, "does not compile")


def _assert_refused(served: Running, change: dict[str, Any], reason: str) -> None:
    """Store ``harness@1`` (the root harness with ``change``) and a release naming it, ask for
    its promotion: refused for ``reason``, and the old release serves on with harness@0."""
    chat = served.server.chat
    old = chat.release
    spec = {**root_harness().model_dump(mode="json"), **change}
    with served.server.pool.connection() as conn, conn.transaction():
        conn.execute(
            "INSERT INTO harness_versions (version, name, sha256, parent_version, spec) "
            "VALUES (1, 'harness@1', %s, 0, %s)",
            (sha256_hex(canonical_json(spec)), Jsonb(spec)),
        )
        child = old.model_copy(
            update={
                "release_id": "rel-unservable",
                "parent_release_id": old.release_id,
                "harness_version": "harness@1",
            }
        )
        create_release(conn, child, active=False)
    request_id = request_promotion(served.server.pool, child.release_id, requested_by="t")
    final = wait_for_request(served.server.pool, request_id, 60)
    assert final.status == "failed" and reason in (final.reason or ""), final
    assert (chat.release, chat.harness.name) == (old, "harness@0")
    with served.server.pool.connection() as conn:
        kinds = conn.execute(
            "SELECT kind FROM promotions WHERE to_release_id = 'rel-unservable'"
        ).fetchall()
        active = conn.execute("SELECT release_id FROM releases WHERE active").fetchone()
    assert [k["kind"] for k in kinds] == ["rejected"]
    assert active is not None and active["release_id"] == old.release_id
    with served.connect(served.key("t-after")) as ws:
        json.loads(ws.recv(timeout=30))
        frames = _ask(ws, "m1")
    assert frames[-1]["type"] == "turn_completed"
    assert _stamps(served, frames[0]["conversation_id"]) == {"harness@0"}


def test_a_release_naming_another_router_version_routes_with_it_from_the_flip(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A retrained classifier is registered and named by a child release: the promotion swaps
    it in with the release, the next turn is decided by it, and a rollback brings the seed
    router back. A release naming a version the registry lacks, or one whose stored model was
    altered, is refused and the router routes on unchanged."""
    own = wiring.seed_router(SentenceEmbedder())  # this test swaps its classifier
    seed = own.model
    coding = seed.specialists.index("coding")
    assert seed.words is not None

    def to_coding(bias: tuple[float, ...]) -> list[float]:
        return [b + (50.0 if i == coding else 0.0) for i, b in enumerate(bias)]

    leaning = RouterModel.create(  # as if corrections had taught it: everything is coding
        seed.specialists,
        seed.weights,
        to_coding(seed.bias),
        seed.training_digest,
        seed.schema_version,
        seed.words.model_copy(update={"bias": tuple(to_coding(seed.words.bias))}),
    )
    settings = Settings(home=tmp_path / "home", database_url=database_url, model_dir=tiny_model)
    with running_server(settings, engine=InstantEngine(_system_prompt), router=own) as served:
        chat, pool = served.server.chat, served.server.pool
        root = chat.release
        with served.connect(served.key("t-router")) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "ready"
            assert _chat_turn(ws, "before")[0]["adapter_version"] == "chat@0"

            with pool.connection() as conn, conn.transaction():
                register_router(conn, leaning, parent=seed.version)
                child = root.successor(router_version=leaning.version)
                create_release(conn, child, active=False)
            request_id = request_promotion(pool, child.release_id, requested_by="t")
            assert wait_for_request(pool, request_id, 60).status == "done"
            assert _serving(chat, child.release_id) == child.release_id
            assert own.version == leaning.version
            assert _chat_turn(ws, "after")[0]["adapter_version"] == "coding@0"
            decided = [e.payload for e in served.events() if isinstance(e.payload, RouterDecided)]
            assert decided[-1].router_version == leaning.version

            back = request_promotion(pool, root.release_id, kind="rollback", requested_by="t")
            assert wait_for_request(pool, back, 60).status == "done"
            assert _serving(chat, root.release_id) == root.release_id
            assert own.version == seed.version
            assert _chat_turn(ws, "back")[0]["adapter_version"] == "chat@0"

            for router_version, reason in [
                ("router-unknown", "no router version"),
                (_altered(pool, leaning, bias=[b + 1.0 for b in leaning.bias]), "does not match"),
                (_altered(pool, leaning, schema_version=9), "does not match"),
            ]:
                with pool.connection() as conn, conn.transaction():
                    bad = root.successor(router_version=router_version)
                    create_release(conn, bad, active=False)
                refused = request_promotion(pool, bad.release_id, requested_by="t")
                final = wait_for_request(pool, refused, 60)
                assert final.status == "failed" and reason in (final.reason or ""), final
                assert (chat.release, own.version) == (root, seed.version)


def test_a_candidate_judged_before_a_router_promotion_is_rebased_onto_it(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A harness candidate judged against the root, promoted after a router-only release:
    its judgement did not depend on the router, so it is promoted as a child of the router
    release, serving both changes, and the promotion record says so. A second router change
    judged against the root overlaps what was promoted since and is refused."""
    own = wiring.seed_router(SentenceEmbedder())
    seed = own.model
    leaning = RouterModel.create(
        seed.specialists,
        seed.weights,
        [b + 1.0 for b in seed.bias],
        seed.training_digest,
        seed.schema_version,
        seed.words,
    )
    settings = Settings(home=tmp_path / "home", database_url=database_url, model_dir=tiny_model)
    with running_server(settings, engine=InstantEngine(_system_prompt), router=own) as served:
        chat, pool = served.server.chat, served.server.pool
        root = chat.release
        with pool.connection() as conn, conn.transaction():
            register_router(conn, leaning, parent=seed.version)
            router_child = root.successor(router_version=leaning.version)
            create_release(conn, router_child, active=False)
            harness = register_harness(conn, _terse_coding(), parent=chat.harness)
            harness_child = root.successor(harness=harness)
            create_release(conn, harness_child, active=False)
        finals = [
            wait_for_request(pool, request_promotion(pool, r.release_id, requested_by="t"), 60)
            for r in (router_child, harness_child)
        ]
        assert [f.status for f in finals] == ["done", "done"]
        expected = router_child.successor(harness=harness)
        assert _serving(chat, expected.release_id) == expected.release_id
        assert chat.release == expected
        assert finals[1].reason == (
            f"rebased onto {router_child.release_id} as {chat.release.release_id}"
        )
        assert (own.version, chat.harness.name) == (leaning.version, "harness@1")
        with pool.connection() as conn:
            reason = conn.execute(
                "SELECT reason FROM promotions WHERE to_release_id = %s", (chat.release.release_id,)
            ).fetchone()
        assert reason is not None
        assert (
            f"{harness_child.release_id} rebased onto {router_child.release_id}" in reason["reason"]
        )
        with served.connect(served.key("t-rebased")) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "ready"
            answer = "".join(f["delta"] for f in _ask(ws, "m1") if f["type"] == "token")
            assert answer == TERSE

        with pool.connection() as conn, conn.transaction():
            other = root.successor(router_version=seed.version + "-unused")
            create_release(conn, other, active=False)
        refused = wait_for_request(
            pool, request_promotion(pool, other.release_id, requested_by="t"), 60
        )
        assert refused.status == "failed" and "evaluated again" in (refused.reason or ""), refused
        assert own.version == leaning.version


def _serving(chat: Any, release_id: str, timeout: float = 10.0) -> str:
    """The id of the release ``chat`` serves once it is ``release_id`` (or at the timeout): the
    listener marks a request done when the flip commits and then swaps what this process
    serves, so a test that read the request's status may look a moment too early."""
    deadline = time.monotonic() + timeout
    while chat.release.release_id != release_id and time.monotonic() < deadline:
        time.sleep(0.05)
    served: str = chat.release.release_id
    return served


def _chat_turn(ws: Any, msg: str) -> list[dict[str, Any]]:
    ws.send(json.dumps({"type": "user_turn", "client_msg_id": msg, "content": "tell me a joke"}))
    return turn_frames(ws)


def _altered(pool: Any, model: RouterModel, **changes: Any) -> str:
    """Store ``model`` with ``changes`` under a version name of its own (as a tampered row, or
    one a later schema wrote, would be); returns the name."""
    name = f"router-altered-{'-'.join(changes)}"
    stored = model.model_dump(mode="json") | changes | {"version": name}
    with pool.connection() as conn:
        conn.execute(
            "INSERT INTO router_versions (router_version, parent_version, model) "
            "VALUES (%s, NULL, %s)",
            (name, Jsonb(stored)),
        )
    return name
