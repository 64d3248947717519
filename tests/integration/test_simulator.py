"""Simulated users against a real server, and the learning-loop demo end to end.

The simulator tests serve with ``InstantEngine`` scripted to answer some bank tasks with their
reference and the others wrongly, so the oracle's verdict on each turn is known in advance.
The demo test runs one generation on the tiny model with real PostgreSQL, Redis and a Celery
worker process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from core.errors import EngineError, InvalidApiKey
from core.events import FeedbackGiven, TurnReceived
from core.settings import Settings
from core.tasks import GenUIChecker, Task
from engines.instant import InstantEngine, Script
from infra.local_stack import LocalStack
from infra.postgres.keys import list_keys
from learners.recipes.config import CPU_CONFIG, RLOO_CONFIG
from learners.tasks import BANK_V2, load_bank
from macaron.cli import app
from macaron.demo import DEMO_MAX_NEW_TOKENS, DemoOptions, demo_settings, run_demo
from macaron.simulator import (
    SIMULATOR_TENANT,
    SimulationReport,
    bank_tasks,
    pick_tasks,
    run_simulation,
)
from server.router import RouterService
from tests.conftest import fresh_database
from tests.serving import Running, running_server

DATA = Path(__file__).resolve().parents[1] / "data"
WRONG_TREE = '{"type": "Text", "text": "nothing to see"}'
FAILING_PROMPT = "Show a card the engine cannot make."
BANK = bank_tasks(load_bank(BANK_V2), ("genui", "agent"))  # the plan below picks from it


def scripted(right: set[str]) -> Script:
    """Answers a bank prompt with its task's reference when the task is in ``right``; any other
    genui prompt with a valid tree that lacks the asked words, any other agent prompt in prose;
    after a tool result, it says it is done. ``FAILING_PROMPT`` fails the generation."""
    answers = {
        task.prompt: task.reference
        if task.id in right
        else WRONG_TREE
        if task.specialist == "genui"
        else "I would rather not."
        for task in BANK
    }

    def script(messages: list[dict[str, str]]) -> str:
        last = messages[-1]["content"]
        if last == FAILING_PROMPT:
            raise EngineError("the scripted engine fails this prompt")
        if last.startswith("Tool result:"):
            return "Done."
        return answers.get(last, "I do not know that one.")

    return script


def serve_settings(
    home: Path, database_url: str, tiny_model: Path, turns_per_minute: int
) -> Settings:
    return Settings(
        home=home,
        database_url=database_url,
        model_dir=tiny_model,
        turns_per_minute=turns_per_minute,
    )


PLAN = pick_tasks(BANK, 12, seed=3)
RIGHT = {task.id for i, task in enumerate(PLAN) if i % 3 != 0}


@pytest.fixture(scope="module")
def served(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    with fresh_database(stack) as url:
        settings = serve_settings(
            tmp_path_factory.mktemp("sim-home"), url, tiny_model, turns_per_minute=1000
        )
        with running_server(
            settings, engine=InstantEngine(scripted(RIGHT)), router=router
        ) as running:
            yield running


def simulate(served: Running, key: str, plan: list[Task], concurrency: int) -> SimulationReport:
    return asyncio.run(run_simulation(served.ws_url, key, plan, concurrency=concurrency))


def test_the_oracle_sends_up_for_right_answers_and_the_reference_for_wrong_ones(
    served: Running,
) -> None:
    assert {t.specialist for t in PLAN} == {"genui", "agent"}
    assert len({t.id for t in PLAN}) == len(PLAN)  # one round: no task twice
    report = simulate(served, served.key("sim-oracle"), PLAN, concurrency=3)

    assert [t.task_id for t in report.turns] == [t.id for t in PLAN]
    assert [t.passed for t in report.turns] == [t.id in RIGHT for t in PLAN]
    total = report.total()
    assert (total.turns, total.answered, total.errors) == (12, 12, 0)
    assert (total.ups, total.edits) == (len(RIGHT), 12 - len(RIGHT))
    for name, stats in report.by_specialist().items():
        mine = [t for t in PLAN if t.specialist == name]
        assert stats.turns == len(mine)
        assert stats.ups == stats.passed == sum(t.id in RIGHT for t in mine)
        assert stats.pass_rate == stats.ups / len(mine) and stats.mean_latency_ms > 0
    agent_right = next(t for t in report.turns if t.specialist == "agent" and t.passed)
    assert json.loads(agent_right.answer or "")["tool"]  # the first tool call, rebuilt

    events = served.events()
    feedback = {
        e.payload.turn_id: e.payload for e in events if isinstance(e.payload, FeedbackGiven)
    }
    received = {e.payload.turn_id: e.payload for e in events if isinstance(e.payload, TurnReceived)}
    by_turn = {
        turn.turn_id: task
        for turn, task in zip(report.turns, PLAN, strict=True)
        if turn.turn_id is not None
    }
    assert feedback.keys() == received.keys() == by_turn.keys()
    for turn_id, task in by_turn.items():
        given = feedback[turn_id]
        if task.id in RIGHT:
            assert (given.kind, given.edited_text) == ("up", None)
        else:
            assert (given.kind, given.edited_text) == ("edit", task.reference)
        assert received[turn_id].specialist_hint == task.specialist
        assert received[turn_id].content == task.prompt
    conversations = {e.envelope.key for e in events if isinstance(e.payload, TurnReceived)}
    assert len(conversations) == 12  # one conversation per task


def test_no_turn_starts_once_until_holds(served: Running) -> None:
    """``until`` is asked after every turn: once it holds, the queued turns are dropped and
    only those under way end (the demo stops its users when a training run is queued)."""
    seen: list[int] = []

    def three_played() -> bool:
        seen.append(1)
        return len(seen) >= 3

    report = asyncio.run(
        run_simulation(
            served.ws_url, served.key("sim-until"), PLAN, concurrency=1, until=three_played
        )
    )
    assert [t.task_id for t in report.turns] == [t.id for t in PLAN[:3]]
    assert len(PLAN) > 3


def test_error_frames_are_counted_and_the_run_goes_on(served: Running) -> None:
    failing = Task(
        id="fails",
        specialist="genui",
        prompt=FAILING_PROMPT,
        checker=GenUIChecker(kind="genui"),
        reference=WRONG_TREE,
    )
    plan = [PLAN[1], failing, PLAN[2]]
    report = simulate(served, served.key("sim-errors"), plan, concurrency=1)
    [failed] = [t for t in report.turns if t.error is not None]
    assert (failed.task_id, failed.error, failed.feedback) == ("fails", "engine_error", None)
    genui = report.by_specialist()["genui"]
    assert (genui.turns, genui.answered, genui.errors, genui.ups) == (3, 2, 1, 2)


def test_an_unknown_key_stops_the_run_with_a_clear_error(served: Running) -> None:
    with pytest.raises(InvalidApiKey, match="refused the key"):
        simulate(served, "mk_not-a-key", PLAN[:2], concurrency=2)


def test_the_command_makes_a_key_and_prints_a_table_per_specialist(served: Running) -> None:
    env = {
        f"MACARON_{name.upper()}": str(value)
        for name, value in served.settings.model_dump(exclude_none=True).items()
    }
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--url",
            served.ws_url,
            "--turns",
            "4",
            "--concurrency",
            "2",
            "--specialists",
            "genui",
            "--seed",
            "1",
        ],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert "genui" in result.output and "pass rate" in result.output
    with served.server.pool.connection() as conn:
        assert [k.scopes for k in list_keys(conn, SIMULATOR_TENANT)] == [("chat",)]


def test_rate_limited_turns_wait_and_are_answered(
    stack: LocalStack, tiny_model: Path, router: RouterService, tmp_path: Path
) -> None:
    """Three turns a minute: the fourth is told to wait until the first is a minute old."""
    plan = PLAN[:4]
    with fresh_database(stack) as url:
        settings = serve_settings(tmp_path, url, tiny_model, turns_per_minute=3)
        with running_server(
            settings, engine=InstantEngine(scripted(RIGHT)), router=router
        ) as limited:
            report = simulate(limited, limited.key("sim-limited"), plan, concurrency=2)
            feedback = [e for e in limited.events() if isinstance(e.payload, FeedbackGiven)]
    assert report.rate_limited >= 1 and sum(t.rate_limited > 0 for t in report.turns) == 1
    total = report.total()
    assert (total.turns, total.answered, total.errors) == (4, 4, 0)
    assert len(feedback) == 4


def test_the_demo_runs_a_generation_and_writes_its_record(
    database_url: str,
    celery_redis_url: str,
    tiny_model: Path,
    router: RouterService,
    tmp_path: Path,
) -> None:
    # The loop's recipe at a few steps: this test is about the demo's run, not about learning.
    training = tmp_path / "training.yaml"
    recipe = yaml.safe_load((DATA / "training-e2e.yaml").read_text())
    training.write_text(yaml.safe_dump({**recipe, "steps": 4}))
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=4,
        contract_path=DATA / "contract-e2e.yaml",
        training_config=training,
        task_visibility_timeout=120,
    )
    assert demo_settings(settings).max_new_tokens == DEMO_MAX_NEW_TOKENS
    assert demo_settings(Settings()).training_config == CPU_CONFIG
    assert demo_settings(Settings(), "self").training_config == RLOO_CONFIG
    settings = settings.model_copy(update={"max_new_tokens": 24})
    chosen = demo_settings(settings)  # chosen settings are kept
    assert chosen.max_new_tokens == 24 and chosen.training_config == training
    out = tmp_path / "demo"
    seen: list[int] = []
    report = run_demo(
        settings,
        DemoOptions(
            generations=1,
            turns_per_generation=12,
            concurrency=2,
            out_dir=out,
            specialists=("genui",),
            run_timeout_s=240,
            outside=False,  # a minute more per generation
        ),
        router=router,
        on_generation=lambda g: seen.append(g.generation),
    )

    assert seen == [0, 1]
    base, first = report.generations
    assert base.runs == [] and set(base.scores) == {"genui", "general"}
    assert 0 < first.turns <= 12 and set(first.simulated_pass_rate) == {"genui"}
    # the adapter run, then the harness-only successor proposed after it was decided
    run, proposal = first.runs
    assert (run.specialist, run.half) == ("genui", "adapter") and run.training_seconds is not None
    assert run.recipe == "training"  # the config it was trained with (training.yaml)
    assert (proposal.specialist, proposal.half, proposal.recipe) == (
        "genui",
        "harness",
        "harness.grammar",
    )
    for decided in first.runs:
        assert decided.outcome in {"promoted", "rejected"}, decided
        assert set(decided.candidate) == set(decided.parent) == {"genui", "general"}
    # the proposal's time is the generation's: after the adapter runs, before the measure
    assert first.phase_seconds["harness proposals"] > 0
    promoted = [r for r in first.runs if r.outcome == "promoted"]
    # the active release is scored as its evaluation recorded it, not a second time
    assert first.scores == (promoted[-1].candidate if promoted else base.scores)
    assert (first.release_id != base.release_id) == bool(promoted)
    assert first.harness_version == ("harness@1" if proposal in promoted else "harness@0")
    assert first.formats == base.formats == {}  # contract-e2e asks for no form
    written = json.loads((out / "demo.json").read_text())
    assert [g["generation"] for g in written["generations"]] == [0, 1]
    assert written["contract_version"] == "contract-e2e"
    assert [r["half"] for r in written["generations"][1]["runs"]] == ["adapter", "harness"]
    assert written["generations"][1]["runs"][0]["run_id"] == run.run_id
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "worker.log").stat().st_size > 0
