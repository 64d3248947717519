"""Self-improvement on the tiny model, with real PostgreSQL, Redis and Celery: rollout jobs ->
``RolloutSampled``/``RolloutScored`` events -> experience from verified samples -> a training run
-> the contract -> promotion, and no reference answer anywhere in what was trained on.

The environments (``tests/data/bank-self-e2e.yaml``) reward a GenUI tree that opens with a
Heading, which the tiny random model writes in about a quarter of its samples under the grammar;
the contract asks the same of held-out prompts, greedily and without the grammar."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import JsonValue

from core.errors import TaskBankInvalid
from core.events import (
    CandidateTrained,
    ExperienceRecorded,
    FeedbackGiven,
    NewEvent,
    RolloutSampled,
    RolloutScored,
    RolloutStep,
    TasksWritten,
)
from core.experience import FILTER_VERSION, experience_key
from core.harness.grammars import call_kinds
from core.harness.hcp import tool_call_of
from core.log import EventLog
from core.settings import Settings
from core.tasks import Task
from infra.postgres.db import Pool
from infra.postgres.registry import active_release, harness_by_name
from infra.postgres.rollout_joins import scored_group
from learners.files import load_yaml_model
from learners.queue import app as celery_app
from learners.queue import configure as configure_celery
from learners.queue import enqueue_rollouts
from learners.rollouts.environments import VERIFIER_VERSION
from learners.rollouts.job import RolloutJob, RolloutSummary, rollout_key
from learners.rollouts.run import run_rollouts
from learners.rollouts.writing import derive_checker
from learners.runtime import Runtime
from learners.tasks import TaskBank
from macaron import wiring
from macaron.demo import DemoOptions, run_demo
from server.releases import ensure_root_release
from server.router import RouterService
from streams.experience_rules import ExperienceBuilder
from streams.processor import content_hash
from streams.replay import replay
from streams.runner import catch_up
from tests.serving import celery_worker, running_server

DATA = Path(__file__).resolve().parents[1] / "data"
BANK = DATA / "bank-self-e2e.yaml"


@pytest.fixture
def self_settings(
    database_url: str, celery_redis_url: str, tiny_model: Path, tmp_path: Path
) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=16,
        contract_path=DATA / "contract-self-e2e.yaml",
        training_config=DATA / "training-self-e2e.yaml",
        task_bank_path=BANK,
        task_visibility_timeout=120,
        max_new_tokens=48,
        harness_proposals=False,
    )


def bank_tasks() -> list[Task]:
    return load_yaml_model(BANK, TaskBank, TaskBankInvalid).tasks


@dataclass
class Stored:
    """What the loop left in PostgreSQL and the log."""

    pool: Pool
    log: EventLog

    def events(self, key: str | None = None) -> list[Any]:
        return list(self.log.read(key=key))


@pytest.fixture
def stored(self_settings: Settings) -> Iterator[Stored]:
    pool = wiring.pool(self_settings)
    log = wiring.event_log(self_settings, pool)
    yield Stored(pool, log)
    log.close()
    pool.close()


def test_the_self_mode_demo_trains_a_successor_without_any_reference_answer(
    self_settings: Settings, router: RouterService, stored: Stored, tmp_path: Path
) -> None:
    """One generation of ``macaron demo --mode self``: rollout jobs through the Celery worker,
    the trigger, a run, the contract and a promotion, on a stack that already holds an
    oracle's edits: they fall in the run's snapshot, and it trains on none of them. (The
    rollout lane samples alike but batches as requests arrive, so its samples, and whether this
    tiny model's run passes, vary from run to run: its own test below counts, not learns.)"""
    edits = hold_oracle_edits(stored, 3)
    report = run_demo(
        self_settings,
        DemoOptions(
            generations=1,
            turns_per_generation=16,
            concurrency=2,
            out_dir=tmp_path / "demo",
            specialists=("genui",),
            run_timeout_s=300,
            mode="self",
            samples=4,
            outside=False,  # on, it took this test from 116 to 245 s in CI
        ),
        router=router,
    )
    base, first = report.generations
    assert (base.mode, base.hints) == ("self", "none")  # measured only, in the demo's mode
    assert base.outside is None and first.outside is None  # not asked for
    assert (first.mode, first.turns, first.simulated_pass_rate) == ("self", 0, {})
    phases = first.phase_seconds
    assert set(phases) == {"traffic", "adapter runs", "harness proposals", "measure"}
    assert phases["adapter runs"] > 0 and phases["harness proposals"] >= 0
    [run] = first.runs
    assert (run.specialist, run.half, run.outcome) == ("genui", "adapter", "promoted")
    assert run.candidate["genui"] > run.parent["genui"]  # learned from itself
    assert first.scores == run.candidate
    sampled = [e.payload for e in stored.events() if isinstance(e.payload, RolloutSampled)]
    scored = [e.payload for e in stored.events() if isinstance(e.payload, RolloutScored)]
    rolled = first.rollouts["genui"]
    assert len(sampled) == len(scored) == rolled["samples"] + rolled["hinted_samples"]
    assert {s.verifier_version for s in scored} == {VERIFIER_VERSION}
    assert 0 < rolled["passed"] < rolled["samples"]
    assert 0 < rolled["pass_at_1"] <= rolled["pass_at_k"] <= 1
    assert 0 < rolled["signal_groups"] <= rolled["groups"]
    assert rolled["signal_share"] == rolled["signal_groups"] / rolled["groups"]
    assert (first.hints, rolled["hinted_groups"], rolled["hinted_samples"]) == ("none", 0, 0)
    snapshot = snapshot_records(stored, first.release_id)
    assert {e.envelope.event_id for e in snapshot} >= edits  # the edits were there to take
    [trained] = [e.payload for e in stored.events() if isinstance(e.payload, CandidateTrained)]
    assert trained.metrics["left_out"] == len(edits)
    trained_on = [e for e in snapshot if e.envelope.event_id not in edits]
    assert_only_own_samples(stored, trained_on, sampled, scored)
    assert_trained_on_every_kind(stored)
    assert_replay_matches_live(self_settings, stored)


def hold_oracle_edits(stored: Stored, count: int) -> set[uuid.UUID]:
    """GenUI records of source ``edit`` in the log, as an oracle-mode demo leaves them (an SFT
    example whose target someone else wrote); their ids."""
    events = [
        NewEvent(
            payload=ExperienceRecorded(
                experience_id=uuid.uuid4(),
                kind="sft",
                specialist="genui",
                turn_id=uuid.uuid4(),
                filter_version=FILTER_VERSION,
                source="edit",
                record={
                    "messages": [{"role": "user", "content": "Title the page for me."}],
                    "target": f'{{"type":"Heading","text":"Edited {n}","level":1}}',
                    "adapter_version": "genui@0",
                    "release_id": None,
                },
            ),
            tenant_id="simulator",
            key=experience_key("genui"),
        )
        for n in range(count)
    ]
    stored.log.append(events)
    return {event.event_id for event in events}


def assert_trained_on_every_kind(stored: Stored) -> None:
    """The run trained on SFT examples, preference pairs and rollout groups (policy gradient)."""
    [trained] = [e.payload for e in stored.events() if isinstance(e.payload, CandidateTrained)]
    assert min(trained.metrics[kind] for kind in ("examples", "pairs", "samples")) >= 1


def snapshot_records(stored: Stored, release_id: str) -> list[Any]:
    """The recorded events of the snapshot the promoted release was trained on."""
    with stored.pool.connection() as conn:
        run = conn.execute(
            "SELECT s.start_positions, s.end_positions FROM releases rel "
            "JOIN training_runs r ON r.run_id = rel.run_id "
            "JOIN dataset_snapshots s USING (snapshot_id) WHERE rel.release_id = %s",
            (release_id,),
        ).fetchone()
    assert run is not None
    [(partition, start)] = run["start_positions"].items()
    [(_, end)] = run["end_positions"].items()
    return [
        e
        for e in stored.events("experience.genui")
        if isinstance(e.payload, ExperienceRecorded)
        and e.position.partition == int(partition)
        and start <= e.position.offset < end
    ]


def assert_only_own_samples(
    stored: Stored,
    trained_on: Sequence[Any],
    sampled: Sequence[RolloutSampled],
    scored: Sequence[RolloutScored],
) -> None:
    """Every answer trained on is one the model sampled (a passed one as an SFT target or a
    chosen answer, a failed one as a rejected answer), each record leads back to its rollouts,
    and no reference answer and no user's edit is anywhere in the log."""
    answers = {s.rollout_id: s.steps[0].output for s in sampled}
    verdict = {s.rollout_id: s.passed for s in scored}
    reward = {s.rollout_id: s.reward for s in scored}
    scored_events = {
        e.envelope.event_id for e in stored.events() if isinstance(e.payload, RolloutScored)
    }
    assert trained_on
    for event in trained_on:
        record: ExperienceRecorded = event.payload
        assert record.turn_id is None and record.rollout_group_id is not None
        assert event.envelope.causation_id in scored_events
        body = record.record
        if record.kind == "sft":
            rollout = uuid.UUID(str(body["rollout_id"]))
            assert body["target"] == answers[rollout] and verdict[rollout]
        elif record.kind == "group":
            entries: list[dict[str, Any]] = json.loads(json.dumps(body["samples"]))
            for entry in entries:
                rollout = uuid.UUID(entry["rollout_id"])
                assert entry["answer"] == answers[rollout]
                assert entry["reward"] == reward[rollout]
        else:
            chosen = uuid.UUID(str(body["chosen_rollout_id"]))
            rejected = uuid.UUID(str(body["rejected_rollout_id"]))
            assert (body["chosen"], body["rejected"]) == (answers[chosen], answers[rejected])
            assert verdict[chosen] and not verdict[rejected]
    everything = json.dumps([e.envelope.to_json() for e in stored.events()])
    for task in bank_tasks():
        assert task.reference not in everything
    assert not [e for e in stored.events() if isinstance(e.payload, FeedbackGiven)]


def assert_replay_matches_live(settings: Settings, stored: Stored) -> None:
    """The experience builder replayed into a fresh schema gives the live tables' hash,
    rollout join state included."""
    hosts = wiring.processor_hosts(settings, stored.log, stored.pool)
    [host] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(host)  # whatever the demo's processors had not read when it stopped
    assert "experience_rollouts" in host.processor.tables
    with stored.pool.connection() as conn:
        live = content_hash(conn, host.processor)
    rebuilt = replay(host.processor, stored.log, stored.pool, end=host.positions())
    assert rebuilt.handled > 0 and rebuilt.digest == live


class HalfCrashing:
    """A verifier that crashes on every other call and passes the rest."""

    name = "half-crashing"
    version = "test-1"

    def __init__(self) -> None:
        self.calls = 0

    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("the verifier fell over")
        return 1.0


@pytest.fixture
def runtime(self_settings: Settings, router: RouterService, tiny_model: Path) -> Iterator[Runtime]:
    """The worker's runtime in this process, on a database with the root release."""
    pool = wiring.pool(self_settings)
    runtime = wiring.learning_runtime(self_settings, pool)
    ensure_root_release(
        pool, runtime.log, runtime.store, tiny_model, router.version, router.specialists
    )
    yield runtime
    runtime.log.close()
    pool.close()


def test_a_crashing_verifier_fails_its_samples_and_a_rerun_appends_nothing(
    runtime: Runtime,
) -> None:
    job = RolloutJob(
        job_id=uuid.uuid4(),
        specialist="genui",
        environments=["self-genui-1"],
        samples=4,
        budget=8,
    )
    first = run_rollouts(runtime, job, HalfCrashing())
    stored = list(runtime.log.read(key=rollout_key(job.job_id)))
    again = run_rollouts(runtime, job, HalfCrashing())
    assert list(runtime.log.read(key=rollout_key(job.job_id))) == stored
    assert (first.samples, first.failed, first.passed, first.hinted_groups) == (4, 2, 2, 0)
    assert first.resampled_groups == 0  # solved: a budget would not sample it again
    assert (again.groups, again.samples) == (0, 0)
    verdicts = [e.payload for e in stored if isinstance(e.payload, RolloutScored)]
    failures = [v for v in verdicts if v.failure is not None]
    assert len(failures) == 2
    assert all(v.reward is None and not v.passed for v in failures)
    assert all("the verifier fell over" in str(v.failure) for v in failures)


def test_an_unsolved_environment_is_sampled_again_with_its_hint(runtime: Runtime) -> None:
    """No sample of the tiny model shows the word its checker wants. By default nothing more
    is sampled; with ``hints: checker`` (the ablation) K more are sampled with the hint after
    the prompt, recorded as their own group; the context a record would teach in never holds
    the hint."""
    unhinted = RolloutJob(
        job_id=uuid.uuid4(), specialist="genui", environments=["self-genui-hint"], samples=2
    )
    summary = run_rollouts(runtime, unhinted)
    assert (summary.groups, summary.passed, summary.hinted_groups) == (1, 0, 0)
    job = RolloutJob(
        job_id=uuid.uuid4(),
        specialist="genui",
        environments=["self-genui-hint"],
        samples=2,
        hints="checker",
    )
    summary = run_rollouts(runtime, job)
    assert (summary.groups, summary.passed, summary.hinted_groups) == (1, 0, 1)
    assert summary.hinted_samples == job.samples
    sampled = [
        e.payload
        for e in runtime.log.read(key=rollout_key(job.job_id))
        if isinstance(e.payload, RolloutSampled)
    ]
    hints = [s.hint for s in sampled]
    assert hints == [None, None, *["Answer with a GenUI tree whose text shows 'Zanzibar'."] * 2]
    assert len({s.group_id for s in sampled}) == 2
    assert all(s.messages == sampled[0].messages for s in sampled)
    assert "Zanzibar" not in json.dumps([m.model_dump() for m in sampled[0].messages])


SWEEP_BANK = """\
version: bank-sweep
tasks:
- {id: sweep-agent-1, specialist: agent, prompt: "Remember that my locker code is Q-5582-Z.",
   checker: {kind: tool_call, tool: notes, args: {op: set}, contains: {value: [Q-5582-Z]}},
   reference: '{"tool": "notes", "args": {"op": "set", "key": "locker", "value": "Q-5582-Z"}}'}
"""


def test_an_unsolved_tool_call_environment_is_swept_call_by_call(
    runtime: Runtime, tmp_path: Path
) -> None:
    """The tiny model never writes the value this task's checker wants, so its groups are
    flat: under a budget of two groups it is sampled once more, anew (other seeds, a group of
    its own), and then, with ``hints: tools``, decoded again, greedily, once per kind of call,
    the first step held to it; no hint is said, each sample records the call it was held to,
    and the stream marks the swept samples as sampled with help (no policy-gradient group is
    built from them) and the adaptive round's as not."""
    bank = tmp_path / "bank-sweep.yaml"
    bank.write_text(SWEEP_BANK)
    update = {"task_bank_path": bank, "max_new_tokens": 256}
    swept = replace(runtime, settings=runtime.settings.model_copy(update=update))
    with runtime.pool.connection() as conn:
        harness = harness_by_name(conn, active_release(conn).harness_version)
    kinds = call_kinds(harness.spec.tools)
    job = RolloutJob(
        job_id=uuid.uuid4(),
        specialist="agent",
        environments=["sweep-agent-1"],
        samples=2,
        budget=5,
        hints="tools",
    )
    summary = run_rollouts(swept, job)
    assert (summary.groups, summary.passed, summary.hinted_groups) == (1, 0, 1)
    assert (summary.resampled_groups, summary.resampled_samples) == (1, 2)
    assert (summary.resampled_passed, summary.resampled_signal) == (0, 0)
    assert summary.by_task == {"sweep-agent-1": (0, 4)}  # both rounds, for the curriculum
    assert summary.hinted_samples == len(kinds)  # one greedy sample per kind of call
    stored = list(runtime.log.read(key=rollout_key(job.job_id)))
    again = run_rollouts(swept, job)  # redelivered: all three groups are in the log
    assert (again.groups, again.resampled_groups, again.hinted_groups) == (0, 0, 0)
    assert list(runtime.log.read(key=rollout_key(job.job_id))) == stored
    sampled = [
        e.payload
        for e in runtime.log.read(key=rollout_key(job.job_id))
        if isinstance(e.payload, RolloutSampled)
    ]
    plain, sweep = sampled[: 2 * job.samples], sampled[2 * job.samples :]
    first, more = plain[: job.samples], plain[job.samples :]
    assert len({s.group_id for s in first}) == len({s.group_id for s in more}) == 1
    assert first[0].group_id != more[0].group_id
    assert not {s.seed for s in first} & {s.seed for s in more}  # the next round draws anew
    assert [s.sample for s in plain] == [0, 1, 0, 1]
    assert [s.first_call for s in plain] == [None] * 2 * job.samples
    assert [s.first_call for s in sweep] == kinds  # each kind once, greedily
    temperatures = [job.temperature] * 2 * job.samples + [0.0] * len(kinds)
    assert [s.temperature for s in sampled] == temperatures
    assert [kind_made(s.steps[0].action) for s in sweep] == kinds
    assert all(s.hint is None and s.messages == plain[0].messages for s in sweep)
    hosts = wiring.processor_hosts(swept.settings, runtime.log, runtime.pool)
    [host] = [h for h in hosts if isinstance(h.processor, ExperienceBuilder)]
    catch_up(host)
    with runtime.pool.connection() as conn:
        groups = (first[0].group_id, more[0].group_id, sweep[0].group_id)
        rows = [scored_group(conn, group_id) for group_id in groups]
    assert [[r.hinted for r in group or ()] for group in rows] == [
        [False] * job.samples,
        [False] * job.samples,
        [True] * len(kinds),
    ]


def kind_made(action: dict[str, JsonValue] | None) -> str | None:
    """The kind of call an episode's first step made (``call_kinds``), or ``None``."""
    if action is None:
        return None
    args = action["args"]
    op = args.get("op") if isinstance(args, dict) else None
    return f"{action['name']}.{op}" if op else str(action["name"])


def test_an_agent_episode_calls_a_tool_sees_the_result_and_goes_on(runtime: Runtime) -> None:
    """Where the verifier judges a tool call, the first step is one by construction (given an
    answer budget that holds the grammar's longest call: a ``notes`` set with a key and a value
    of ``ARGS_MAX_TEXT`` characters each; the suite's 48 tokens do not); the episode's tool
    state runs it and the model is shown the result before its next step."""
    roomy = replace(runtime, settings=runtime.settings.model_copy(update={"max_new_tokens": 256}))
    job = RolloutJob(
        job_id=uuid.uuid4(), specialist="agent", environments=["self-agent-1"], samples=2
    )
    run_rollouts(roomy, job)
    sampled = [
        e.payload
        for e in runtime.log.read(key=rollout_key(job.job_id))
        if isinstance(e.payload, RolloutSampled) and e.payload.hint is None
    ]
    assert len(sampled) == 2
    for episode in sampled:
        first = episode.steps[0]
        assert tool_call_of(first.output) is not None and first.action is not None
        assert first.action["name"] == tool_call_of(first.output).tool  # type: ignore[union-attr]
        assert len(episode.steps) == 2  # it went on after seeing the result


def test_a_job_writes_tasks_keeps_the_checkable_ones_and_a_redelivery_writes_nothing_new(
    runtime: Runtime,
) -> None:
    """An agent job that writes two tasks records the writer's proposals once, before any
    sample, each kept with the checker its rule derived or dropped with a reason; kept ones are
    rolled out as environments of their own. A redelivered job reads them back and appends
    nothing."""
    roomy = replace(runtime, settings=runtime.settings.model_copy(update={"max_new_tokens": 256}))
    job = RolloutJob(
        job_id=uuid.uuid4(),
        specialist="agent",
        environments=["self-agent-1"],
        samples=2,
        written=2,
    )
    summary = run_rollouts(roomy, job)
    stored = list(runtime.log.read(key=rollout_key(job.job_id)))
    [written] = [e.payload for e in stored if isinstance(e.payload, TasksWritten)]
    assert stored[0].payload == written  # written before any sample
    assert len(written.proposals) == summary.written == 2
    assert written.writer_version == "writer-1" and written.adapter_version is not None
    assert written.adapter_version.startswith("chat@")  # the chat adapter writes requests
    kept = [Task.model_validate(p.task) for p in written.proposals if p.task is not None]
    assert summary.written_kept == len(kept)
    assert sum(summary.written_dropped.values()) == 2 - len(kept)
    for proposal in written.proposals:
        checker = derive_checker("calculator", proposal.prompt)
        if proposal.task is None:
            assert proposal.dropped in ("no_checker", "copies_the_bank", "near_a_contract_task")
            assert proposal.dropped != "no_checker" or checker is None
        else:
            assert Task.model_validate(proposal.task).checker == checker
    sampled = {e.payload.environment for e in stored if isinstance(e.payload, RolloutSampled)}
    assert sampled == {"bank-self-e2e/self-agent-1", *(f"written/{t.id}" for t in kept)}
    assert summary.groups == 1 + len(kept)
    again = run_rollouts(roomy, job)
    assert list(runtime.log.read(key=rollout_key(job.job_id))) == stored
    assert (again.written, again.written_kept, again.groups) == (2, len(kept), 0)


def test_a_worker_killed_mid_rollout_is_redelivered_and_appends_nothing_twice(
    self_settings: Settings, runtime: Runtime, tmp_path: Path
) -> None:
    """SIGKILL once the first group is recorded: the job goes back to the queue, another
    worker samples what was left (the seeds derive from the job, so a half-sampled group is
    sampled again alike) and every group is in the log once."""
    settings = self_settings.model_copy(update={"task_visibility_timeout": 5})
    configure_celery(settings)
    environments = [f"self-genui-{n}" for n in range(1, 9)]
    job = RolloutJob(job_id=uuid.uuid4(), specialist="genui", environments=environments, samples=8)

    def scored() -> int:
        events = runtime.log.read(key=rollout_key(job.job_id))
        return sum(1 for e in events if isinstance(e.payload, RolloutScored))

    with celery_worker(settings, tmp_path / "worker-1.log") as first:
        enqueue_rollouts(job)
        wait_until(lambda: scored() > 0, 180, first, tmp_path / "worker-1.log")
        first.kill()  # SIGKILL
        first.wait(timeout=30)
    assert scored() < 8 * len(environments)  # killed mid-job
    with celery_worker(settings, tmp_path / "worker-2.log") as second:
        done = f"macaron.sample_rollouts[{job.job_id}] succeeded"
        log = tmp_path / "worker-2.log"
        wait_until(lambda: done in log.read_text(errors="replace"), 300, second, log)
    sampled = [
        e.payload
        for e in runtime.log.read(key=rollout_key(job.job_id))
        if isinstance(e.payload, RolloutSampled)
    ]
    verdicts = [
        e.payload.rollout_id
        for e in runtime.log.read(key=rollout_key(job.job_id))
        if isinstance(e.payload, RolloutScored)
    ]
    assert len({s.rollout_id for s in sampled}) == len(sampled) == len(set(verdicts))
    assert len(verdicts) == len(sampled)
    unhinted = Counter(s.environment.split("/")[-1] for s in sampled if s.hint is None)
    assert unhinted == dict.fromkeys(environments, 8)


def wait_until(done: Callable[[], bool], timeout_s: float, worker: Any, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(log.read_text(errors="replace")[-4000:])
        time.sleep(0.1)


def test_the_chat_servers_rollout_lane_samples_jobs_and_hands_back_the_one_it_stops_in(
    self_settings: Settings, router: RouterService, stored: Stored, tmp_path: Path
) -> None:
    """Rollout jobs sampled on the chat server's own engine, no worker running; a server
    stopped mid-job hands it back to the queue, a worker finishes it and every group is in the
    log once."""
    configure_celery(self_settings)
    quick = RolloutJob(
        job_id=uuid.uuid4(), specialist="genui", environments=["self-genui-1"], samples=4
    )
    environments = [f"self-genui-{n}" for n in range(1, 9)]
    long = RolloutJob(job_id=uuid.uuid4(), specialist="genui", environments=environments, samples=8)

    def scored(job: RolloutJob) -> list[RolloutScored]:
        events = stored.log.read(key=rollout_key(job.job_id))
        return [e.payload for e in events if isinstance(e.payload, RolloutScored)]

    with running_server(self_settings, router=router) as served:
        served.server.serve_rollouts(self_settings)
        enqueue_rollouts(quick)
        summary = result_of(quick, 120)
        assert (summary.groups, summary.samples, len(scored(quick))) == (1, 4, 4)
        enqueue_rollouts(long)
        deadline = time.monotonic() + 120
        while not scored(long):
            assert time.monotonic() < deadline, "the lane recorded no group of the long job"
            time.sleep(0.05)
    lane_groups = {v.group_id for v in scored(long)}
    assert len(scored(long)) == 8 * len(lane_groups) < 8 * len(environments)  # stopped mid-job
    with celery_worker(self_settings, tmp_path / "worker.log"):
        assert result_of(long, 300).groups == len(environments) - len(lane_groups)
    verdicts = scored(long)
    assert len({v.rollout_id for v in verdicts}) == len(verdicts) == 8 * len(environments)


def result_of(job: RolloutJob, timeout_s: float) -> RolloutSummary:
    """The job's summary, polled as the demo does (a result's ``get`` waits on a subscription
    that the lane's publishing, in this same process, does not wake)."""
    result = celery_app.AsyncResult(str(job.job_id))
    deadline = time.monotonic() + timeout_s
    while not result.ready():
        assert time.monotonic() < deadline, f"rollout job {job.job_id} did not finish"
        time.sleep(0.1)
    return RolloutSummary.model_validate(result.result)
