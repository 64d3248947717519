"""Promotion and the turns in flight: a turn keeps the release it began with until it ends, even
when the flip comes before it reaches the engine; the old adapters go when its last turn ends."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.routing import RouterDecision
from core.settings import Settings
from infra.artifacts import write_identity_adapter
from infra.postgres.promotions import request_promotion, wait_for_request
from server.engines.instant import InstantEngine, fixed_reply
from server.router import RouterService
from tests.serving import Running, running_server, successor, turn_frames


class GatedRouter:
    """The real router, made to wait at a gate: it holds a turn after the turn has taken its
    release and before it reaches the engine."""

    def __init__(self, router: RouterService) -> None:
        self.router = router
        self.entered = threading.Event()
        self.gate = threading.Event()

    def route(self, text: str, hint: str | None = None) -> RouterDecision:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return self.router.route(text, hint)

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
    engine = InstantEngine(fixed_reply("done"))  # unloads at once: no drain of its own
    try:
        with running_server(settings, engine=engine, router=gate) as served:
            yield served, gate
    finally:
        gate.gate.set()


def promote(served: Running, tiny_model: Path, folder: Path, specialist: str, seed: int) -> None:
    """Make a child of the active release with a new ``specialist`` adapter active."""
    write_identity_adapter(tiny_model, folder, base_model=tiny_model.name, rank=4, seed=seed)
    child = successor(served, folder, 4, specialist)
    request_id = request_promotion(served.server.pool, child.release_id, requested_by="t")
    assert wait_for_request(served.server.pool, request_id, 60)["status"] == "done"
    assert served.server.chat.release.release_id == child.release_id


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
