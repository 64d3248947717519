"""The serving engine shared by chat and the rollout lane (``engines.shared``), on the tiny
local model: background requests start only when chat leaves the engine quiet, hold at most
their slots, a closed view refuses new requests while the ones in flight finish, and chat
unloads an adapter a view holds only once the view is closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine import Engine, GenerationRequest, SamplingParams
from core.errors import EngineUnavailable, EngineWithdrawn
from engines.local.engine import LocalEngine
from engines.shared import QUIET_S, SharedEngine
from tests.factories import make_adapter


@pytest.fixture
def shared(tiny_model: Path) -> Iterator[SharedEngine]:
    engine = SharedEngine(LocalEngine(tiny_model))
    yield engine
    engine.close()


def request(name: str, tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=name,
        prompt="Paris is",
        params=SamplingParams(max_tokens=tokens, ignore_eos=True),
    )


async def timed(engine: Engine, req: GenerationRequest) -> tuple[float, float, int]:
    """When its first and last chunk came, and how many tokens it gave."""
    first, tokens = None, 0
    async for chunk in engine.generate(req):
        first = first or time.monotonic()
        tokens += len(chunk.token_ids)
    assert first is not None
    return first, time.monotonic(), tokens


def test_a_background_request_waits_for_chat_to_finish(shared: SharedEngine) -> None:
    background = shared.background(4)

    async def both() -> tuple[tuple[float, float, int], tuple[float, float, int]]:
        chat = asyncio.create_task(timed(shared, request("chat", 24)))
        await asyncio.sleep(0.05)  # the turn is in flight
        rollout = asyncio.create_task(timed(background, request("rollout", 4)))
        return await chat, await rollout

    (_, chat_done, chat_tokens), (rollout_first, _, rollout_tokens) = asyncio.run(both())
    assert (chat_tokens, rollout_tokens) == (24, 4)
    assert rollout_first >= chat_done + QUIET_S * 0.9  # not before the engine was quiet
    assert shared.quiet() and background.in_flight() == 0


def test_background_requests_hold_at_most_their_slots(shared: SharedEngine) -> None:
    background = shared.background(2)
    seen: list[int] = []

    async def run() -> list[tuple[float, float, int]]:
        rollouts = [asyncio.create_task(timed(background, request(f"r{n}", 6))) for n in range(5)]
        while not all(r.done() for r in rollouts):
            seen.append(background.in_flight())
            await asyncio.sleep(0.005)
        return [r.result() for r in rollouts]

    done = asyncio.run(run())
    assert [tokens for _, _, tokens in done] == [6] * 5
    assert max(seen) == 2  # full, never over


def test_a_closed_view_refuses_new_requests_and_lets_running_ones_finish(
    shared: SharedEngine,
) -> None:
    background = shared.background(2)

    async def run() -> tuple[float, float, int]:
        running = asyncio.create_task(timed(background, request("running", 16)))
        while background.in_flight() == 0:
            await asyncio.sleep(0.005)
        background.close()
        with pytest.raises(EngineWithdrawn):
            await timed(background, request("late", 4))
        return await running

    _, _, tokens = asyncio.run(run())
    assert tokens == 16
    assert asyncio.run(timed(shared, request("chat", 3)))[2] == 3


def test_an_adapter_a_view_holds_is_unloaded_only_once_the_view_is_closed(
    shared: SharedEngine, tiny_model: Path, tmp_path: Path
) -> None:
    """A promotion unloads the old release's adapter while a rollout job samples with it: the
    job keeps it until it ends; an adapter no view holds is unloaded at once."""
    folder = str(make_adapter(tiny_model, tmp_path / "genui-1", 4, ["q_proj", "v_proj"], 3))
    other = str(make_adapter(tiny_model, tmp_path / "genui-2", 4, ["q_proj", "v_proj"], 4))
    shared.load_adapter("genui@1", folder)
    shared.load_adapter("genui@2", other)
    job = shared.background(2)
    job.load_adapter("genui@1", folder)  # loaded already: pinned all the same
    shared.unload_adapter("genui@1")
    shared.unload_adapter("genui@2")
    assert shared.loaded_adapters() == ["genui@1"]
    pinned = request("step", 2).model_copy(update={"adapter": "genui@1"})
    assert asyncio.run(timed(job, pinned))[2] == 2  # the job's next step still finds it
    job.close()
    assert shared.loaded_adapters() == []


@pytest.mark.parametrize("view_closed", [True, False])
def test_a_request_the_engine_stops_under_is_withdrawn_only_if_its_view_was_closed(
    tiny_model: Path, view_closed: bool
) -> None:
    """The server closes the lane's view, then (its grace over) shuts the engine down: the
    request still running was withdrawn (its job goes back to the queue). An engine shut down
    under an open view is plainly unavailable."""
    shared = SharedEngine(LocalEngine(tiny_model))
    background = shared.background(1)

    async def run() -> None:
        running = asyncio.create_task(timed(background, request("long", 200)))
        while background.in_flight() == 0:
            await asyncio.sleep(0.005)
        if view_closed:
            background.close()
        shared.close()
        await running

    with pytest.raises(EngineUnavailable) as caught:
        asyncio.run(run())
    assert isinstance(caught.value, EngineWithdrawn) is view_closed
