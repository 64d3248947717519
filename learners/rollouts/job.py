"""A rollout job: sample K episodes per environment from the active release
(``learners.rollouts.episodes``), verify each, and append them to the log as ``RolloutSampled``
and ``RolloutScored`` events (the rollout worker's job, Celery queue ``rollout``).

A job names a specialist, the bank tasks to roll out and K. Each environment's K samples form a
group, sampled concurrently through the ``Engine`` port (the engine batches them and shares the
prompt's prefill through its prefix cache), each with its own seed, in the specialist's context
under the release's harness, its output grammar always enforced (so the reward measures
content) and, where the verifier judges a tool call, a tool call required as the first step
(otherwise the base model of an agent answers in prose and no sample can pass).

Adaptive sampling: a job with a ``budget`` above K samples K more of each environment whose
groups so far are flat (verified rewards all alike, none passed: nothing for a policy gradient
to learn, no answer to imitate), as a group of its own, round after round until one carries
signal or the budget is spent. A job may first write tasks of its own (``written``;
``learners.rollouts.writing``), recorded in one ``TasksWritten`` event and rolled out beside the
bank's. A job with ``hints: tools`` then sweeps each tool-call
environment none of whose samples passed: it decodes, greedily, one episode per kind of call of
the harness's tools (a tool, or each op of a tool with ops: ``notes.set``, ``notes.get``, ...),
the first step held to that kind; with ``hints: checker`` (an ablation;
``learners.rollouts.environments``), K more with the checker's hint after the prompt, for each
environment none of whose samples passed (STaR-style rationalization).
The experience builder trains on what verifies, in the context without the hint.

Ids derive from the job, the environment and the sample, and a group's events are appended in
one batch, so a redelivered job skips the groups its log already holds and appends nothing
twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast, get_args
from uuid import UUID

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from core.engine import Engine
from core.errors import EventIdConflict, InvalidEvent, MacaronError
from core.events import (
    ChatMessage,
    NewEvent,
    RolloutSampled,
    RolloutScored,
    TasksWritten,
    WrittenProposal,
)
from core.harness.artifact import HarnessVersion
from core.harness.grammars import call_kinds
from core.harness.hcp import build_context
from core.ids import derived_id
from core.log import EventLog
from core.release import Release
from core.routing import SpecialistName
from core.tasks import Task
from infra.artifacts import load_release
from infra.postgres.registry import active_release, harness_by_name
from learners.evaluation.contract_runner import (
    CONCURRENCY,
    held_out_tasks,
    load_contract,
    load_training_bank,
)
from learners.rollouts.environments import (
    CheckerVerifier,
    Environment,
    HintMode,
    Verifier,
    judge,
)
from learners.rollouts.episodes import Group, Sampler
from learners.rollouts.writing import (
    FAMILIES,
    WRITER_VERSION,
    DropReason,
    Written,
    family_examples,
    propose_tasks,
)
from learners.runtime import Runtime
from learners.tasks import DEFAULT_BANK

ROLLOUT_TENANT = "system"
_log = logging.getLogger(__name__)


class RolloutInvalid(MacaronError):
    """A rollout job names an unknown environment or one of another specialist."""

    code = "rollout_invalid"


class RolloutJob(BaseModel):
    """What one rollout task samples (its Celery task id is ``job_id``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: UUID
    specialist: SpecialistName
    environments: list[str] = Field(min_length=1, max_length=256)
    """Bank task ids, each rolled out once (a job of many is better split: its groups are
    recorded as they finish, but a job longer than the task visibility timeout is given to a
    second worker while the first still runs)."""
    samples: int = Field(default=8, ge=1, le=16)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    temperature: float = Field(default=0.8, gt=0.0, le=2.0)
    hints: HintMode = "none"
    """``tools``: resample unsolved tool-call groups with each kind of call in turn forced;
    ``checker``: resample unsolved groups with the checker's hint (an ablation)."""
    written: int = Field(default=0, ge=0, le=32)
    """Tasks the loop writes itself before sampling (``learners.rollouts.writing``): prompts
    the writer proposes in the specialist's family, kept when a rule derives their checker,
    and rolled out beside the bank's environments (genui and agent have a family)."""
    budget: int | None = Field(default=None, ge=1, le=64)
    """Samples per environment at most (adaptive sampling; ``None``: ``samples``, no more). A
    group with no signal (its verified rewards all alike) and no pass is sampled again, K more
    at a time and recorded as a group of its own, until one carries signal or the budget is
    spent; only then is the environment given up (or swept, with ``hints``)."""

    @model_validator(mode="after")
    def _budget_holds_a_group(self) -> RolloutJob:
        if self.budget is not None and self.budget < self.samples:
            raise ValueError(f"budget {self.budget} is less than one group of {self.samples}")
        return self

    @property
    def rounds(self) -> int:
        """Groups of K an environment may be sampled in, the budget spent."""
        return (self.budget or self.samples) // self.samples

    @field_validator("environments")
    @classmethod
    def _each_once(cls, environments: list[str]) -> list[str]:
        repeated = sorted({e for e in environments if environments.count(e) > 1})
        if repeated:
            raise ValueError(f"environments named more than once: {', '.join(repeated)}")
        return environments


class RolloutSummary(BaseModel):
    """What a job sampled: groups and samples (hinted ones apart), how many passed, how many the
    verifier could not judge, pass@1 and pass@K over the first groups, the groups with signal
    (verified rewards not all equal: the only ones a policy gradient learns from), the groups
    sampled again for want of signal (``resampled_*``: groups, samples, passes, and those with
    signal), the tasks the job wrote (``written_*``: proposed, kept, solved by some sample, and
    dropped per reason) and, per task, its samples passed and judged in all (what a curriculum
    weighs)."""

    model_config = ConfigDict(frozen=True)

    job_id: UUID
    groups: int
    samples: int
    passed: int
    failed: int
    pass_at_1: float
    pass_at_k: float
    signal_groups: int
    resampled_groups: int
    resampled_samples: int
    resampled_passed: int
    resampled_signal: int
    written: int
    written_kept: int
    written_solved: int
    written_dropped: dict[str, int]
    hinted_groups: int
    hinted_samples: int
    hinted_passed: int
    seconds: float
    by_task: dict[str, tuple[int, int]]


def rollout_key(job_id: UUID) -> str:
    """The log key of one job's events (one key: a group's samples precede their verdicts)."""
    return f"rollouts.{job_id}"


def group_id_of(job_id: UUID, environment: Environment, hinted: bool, round_: int = 0) -> UUID:
    """A group's id: of the job, the environment, whether it was sampled with help, and (after
    the first) the round of adaptive sampling it was drawn in."""
    if round_ == 0:
        return derived_id("rollout-group", job_id, environment.id, hinted)
    return derived_id("rollout-group", job_id, environment.id, hinted, round_)


# --- sampling ---------------------------------------------------------------------------------


def swept_calls(sampler: Sampler, job: RolloutJob, hinted: bool) -> list[str | None]:
    """Per sample, the kind of call a sweep holds its first step to: on a resampled group of a
    ``tools`` job, every kind of call of the harness's tools once, in their order
    (``call_kinds``); else K times ``None`` (any call)."""
    kinds = call_kinds(sampler.harness.spec.tools)
    if not (hinted and job.hints == "tools" and kinds):
        return [None] * job.samples
    return list(kinds)


def sample_seed(job: RolloutJob, environment: Environment, hinted: bool, sample: int) -> int:
    """A sample's seed: derived from the job (its id and seed), so a redelivered job samples
    alike and another job on the same prompt explores anew; ``sample`` counts on across the
    rounds of adaptive sampling (round r's k-th is r*K + k), so each round draws anew."""
    parts = ("rollout-seed", job.job_id, job.seed, environment.id, hinted, sample)
    return derived_id(*parts).int % 2**31


async def sample_groups(
    sampler: Sampler,
    job: RolloutJob,
    environments: Sequence[Environment],
    verifier: Verifier,
    record: Callable[[Group], None],
    *,
    hinted: bool,
    round_: int = 0,
) -> list[Group]:
    """Every environment's K episodes at once (the engine batches them, at most ``CONCURRENCY``
    requests in flight), of adaptive sampling's round ``round_``; as each group is sampled,
    its verdicts and ``record`` (both may block: they run in a thread, one group at a time),
    so what a job did survives a crash."""
    slots, recording = asyncio.Semaphore(CONCURRENCY), asyncio.Lock()

    first_calls = swept_calls(sampler, job, hinted)
    if any(first_calls):  # a sweep: the model's best call of each kind
        sampler = replace(sampler, temperature=0.0)

    async def group(environment: Environment) -> Group:
        hint = environment.hint(job.hints) if hinted else None
        first = round_ * len(first_calls)
        seeds = [sample_seed(job, environment, hinted, first + k) for k in range(len(first_calls))]
        episodes = await asyncio.gather(
            *(
                sampler.episode(environment, hint, seed, slots, call)
                for seed, call in zip(seeds, first_calls, strict=True)
            )
        )
        async with recording:
            verdicts = await asyncio.to_thread(
                lambda: [judge(verifier, environment.task, steps) for steps in episodes]
            )
            temperature = sampler.temperature
            done = Group(
                environment, hinted, hint, first_calls, temperature, episodes, verdicts, round_
            )
            await asyncio.to_thread(record, done)
        return done

    return list(await asyncio.gather(*(group(env) for env in environments)))


# --- events -----------------------------------------------------------------------------------


def group_events(
    job: RolloutJob, release: Release, harness: HarnessVersion, group: Group, verifier: Verifier
) -> list[NewEvent]:
    """A group's ``RolloutSampled`` events, then its ``RolloutScored`` events."""
    env, hinted = group.environment, group.second_look
    group_id = group_id_of(job.job_id, env, hinted, group.round)
    first_sample = group.round * len(group.episodes)
    adapter = release.adapter_for(job.specialist)
    messages = build_context(harness, job.specialist, [], env.task.prompt).messages()
    sampled, scored = [], []
    samples = zip(group.first_calls, group.episodes, group.verdicts, strict=True)
    for k, (first_call, steps, verdict) in enumerate(samples):
        rollout_id = derived_id("rollout", group_id, k)
        sampled.append(
            RolloutSampled(
                rollout_id=rollout_id,
                group_id=group_id,
                job_id=job.job_id,
                sample=k,
                group_size=len(group.episodes),
                environment=env.id,
                specialist=job.specialist,
                release_id=release.release_id,
                adapter_version=None if adapter is None else adapter.name,
                harness=harness.stamp,
                messages=[ChatMessage.model_validate(m) for m in messages],
                hint=group.hint,
                first_call=first_call,
                seed=sample_seed(job, env, hinted, first_sample + k),
                temperature=group.temperature,
                steps=steps,
            )
        )
        scored.append(
            RolloutScored(
                rollout_id=rollout_id,
                group_id=group_id,
                verifier=verifier.name,
                verifier_version=verifier.version,
                reward=verdict.reward,
                passed=verdict.passed,
                failure=verdict.failure,
            )
        )
    payloads: list[RolloutSampled | RolloutScored] = [*sampled, *scored]
    return [
        NewEvent(
            payload=payload,
            tenant_id=ROLLOUT_TENANT,
            key=rollout_key(job.job_id),
            event_id=derived_id("rollout-event", payload.event_type, payload.rollout_id),
            correlation_id=group_id,
        )
        for payload in payloads
    ]


def recorded_verdicts(log: EventLog, job_id: UUID) -> dict[UUID, list[RolloutScored]]:
    """The groups of ``job_id`` the log holds, each with its verdicts."""
    verdicts: dict[UUID, list[RolloutScored]] = {}
    for event in log.read(key=rollout_key(job_id), types=["RolloutScored"]):
        verdict = event.payload
        if isinstance(verdict, RolloutScored):
            verdicts.setdefault(verdict.group_id, []).append(verdict)
    return verdicts


def flat(verdicts: Sequence[RolloutScored]) -> bool:
    """Whether a group teaches a policy gradient nothing and found no answer: its verified
    rewards all alike and none passed (a group the verifier could not judge at all is not
    flat: sampling it again would fail alike)."""
    rewards = {v.reward for v in verdicts if v.reward is not None}
    return len(rewards) == 1 and not any(v.passed for v in verdicts)


# --- the job ----------------------------------------------------------------------------------


def run_rollouts(rt: Runtime, job: RolloutJob, verifier: Verifier | None = None) -> RolloutSummary:
    """Sample, verify and record the job's groups on a fresh engine with the active release's
    adapter for the specialist loaded: a group of K per environment, more for those whose
    groups so far are flat (up to the budget), then, with hints, a second look at those no
    sample solved. Groups the log already holds are not sampled again."""
    started = time.monotonic()
    verifier = verifier or CheckerVerifier()
    contract = load_contract(rt.contract_path)
    bank = load_training_bank(rt.settings.task_bank_path or DEFAULT_BANK, contract)
    known = {task.id: Environment(bank.version, task) for task in bank.tasks}
    environments = _environments(job, known)
    with rt.pool.connection() as conn:
        release = active_release(conn)
        harness = harness_by_name(conn, release.harness_version)
    engine = rt.contract_engine()

    def record(group: Group) -> None:
        try:
            rt.log.append(group_events(job, release, harness, group, verifier))
        except EventIdConflict:  # a redelivered job ran beside the first: its samples stand
            _log.warning(
                "group %s of job %s was recorded meanwhile", group.environment.id, job.job_id
            )

    def roll(
        sampler: Sampler, todo: Sequence[Environment], hinted: bool, round_: int = 0
    ) -> list[Group]:
        """Sample and record the groups of ``todo`` the log does not hold yet."""
        recorded = recorded_verdicts(rt.log, job.job_id)
        todo = [e for e in todo if group_id_of(job.job_id, e, hinted, round_) not in recorded]
        groups = sample_groups(sampler, job, todo, verifier, record, hinted=hinted, round_=round_)
        return asyncio.run(groups)

    def rounds_of(env: Environment, upto: int) -> list[list[RolloutScored]]:
        recorded = recorded_verdicts(rt.log, job.job_id)
        return [recorded.get(group_id_of(job.job_id, env, False, r), []) for r in range(upto)]

    try:
        sampler = _sampler(rt, engine, release, harness, job)
        written = write_tasks(rt, job, engine, release, bank.tasks, held_out_tasks(contract))
        environments += [Environment(WRITTEN, w.task) for w in written if w.task is not None]
        groups = roll(sampler, environments, False)
        resampled: list[Group] = []
        for round_ in range(1, job.rounds):
            todo = [env for env in environments if all(map(flat, rounds_of(env, round_)))]
            resampled += roll(sampler, todo, False, round_)
        unsolved = [
            env
            for env in environments
            if env.resampled(job.hints)
            and not any(v.passed for group in rounds_of(env, job.rounds) for v in group)
        ]
        hinted = roll(sampler, unsolved, True)
    finally:
        engine.close()
    return _summary(job, groups, resampled, hinted, written, time.monotonic() - started)


def _environments(job: RolloutJob, known: dict[str, Environment]) -> list[Environment]:
    chosen = []
    for task_id in job.environments:
        env = known.get(task_id)
        if env is None:
            raise RolloutInvalid(f"no environment {task_id!r} in the task bank")
        if env.task.specialist != job.specialist:
            raise RolloutInvalid(
                f"environment {task_id!r} is a {env.task.specialist} task, not {job.specialist}"
            )
        chosen.append(env)
    return chosen


# --- tasks the job writes itself ---------------------------------------------------------------

WRITTEN = "written"
"""The ``bank_version`` of a written task's environment (its id: ``written/written-<hash>``)."""


def write_tasks(
    rt: Runtime,
    job: RolloutJob,
    engine: Engine,
    release: Release,
    bank: Sequence[Task],
    held_out: Sequence[Task],
) -> list[Written]:
    """The job's ``written`` proposals, each kept as a task or dropped (recorded in one
    ``TasksWritten`` event before any is sampled; a redelivered job reads them back). The
    release's chat adapter writes where it has one (a chat specialist writes requests; one
    trained to answer in trees or calls writes those), else the job's specialist's."""
    if not job.written:
        return []
    recorded = [
        e.payload
        for e in rt.log.read(key=rollout_key(job.job_id), types=["TasksWritten"])
        if isinstance(e.payload, TasksWritten)
    ]
    if recorded:
        return [_from_proposal(p) for p in recorded[0].proposals]
    family = next((f for f, s in FAMILIES.items() if s == job.specialist), None)
    if family is None:
        raise RolloutInvalid(
            f"the loop writes no {job.specialist} tasks: it writes "
            + ", ".join(f"{s} ({f})" for f, s in FAMILIES.items())
        )
    if not family_examples(family, bank):
        raise RolloutInvalid(f"the task bank has no {family} task to show the writer")
    writer = release.adapter_for("chat") or release.adapter_for(job.specialist)
    if writer is not None:
        load_release(engine, rt.store, release, [writer.specialist])
    seeds = [
        derived_id("writer-seed", job.job_id, job.seed, n).int % 2**31 for n in range(job.written)
    ]
    name = None if writer is None else writer.name
    written = asyncio.run(propose_tasks(engine, name, family, bank, held_out, seeds))
    event = TasksWritten(
        job_id=job.job_id,
        specialist=job.specialist,
        release_id=release.release_id,
        adapter_version=None if writer is None else writer.name,
        writer_version=WRITER_VERSION,
        proposals=[
            WrittenProposal(
                family=w.family,
                prompt=w.prompt,
                task=None if w.task is None else w.task.model_dump(mode="json"),
                dropped=w.dropped,
            )
            for w in written
        ],
    )
    try:
        rt.log.append(
            [
                NewEvent(
                    payload=event,
                    tenant_id=ROLLOUT_TENANT,
                    key=rollout_key(job.job_id),
                    event_id=derived_id("tasks-written", job.job_id),
                )
            ]
        )
    except EventIdConflict:  # a redelivered job wrote beside the first: the first's stand
        return write_tasks(rt, job, engine, release, bank, held_out)
    return written


def _from_proposal(proposal: WrittenProposal) -> Written:
    """A recorded proposal read back; ``InvalidEvent`` for one no writer of this version
    could have made."""
    if proposal.family not in FAMILIES or proposal.dropped not in (None, *get_args(DropReason)):
        raise InvalidEvent(f"a written task of unknown family or reason: {proposal!r}"[:500])
    try:
        task = None if proposal.task is None else Task.model_validate(proposal.task)
    except ValidationError as exc:
        raise InvalidEvent(f"a written task that is no task: {exc}"[:500]) from exc
    return Written(
        proposal.family, proposal.prompt, task, cast(DropReason | None, proposal.dropped)
    )


def _sampler(
    rt: Runtime, engine: Engine, release: Release, harness: HarnessVersion, job: RolloutJob
) -> Sampler:
    """A sampler of the release's adapter for the job's specialist (loaded if the engine lacks
    it; asked for even if it has it, so a shared engine's view pins it for the job), capped at
    the settings' answer length."""
    load_release(engine, rt.store, release, [job.specialist])
    adapter = release.adapter_for(job.specialist)
    decoding = harness.spec.for_specialist(job.specialist).decoding
    return Sampler(
        engine=engine,
        harness=harness,
        specialist=job.specialist,
        adapter=None if adapter is None else adapter.name,
        temperature=job.temperature,
        max_tokens=min(decoding.max_new_tokens, rt.settings.max_new_tokens),
    )


def _summary(
    job: RolloutJob,
    groups: list[Group],
    resampled: list[Group],
    hinted: list[Group],
    written: list[Written],
    seconds: float,
) -> RolloutSummary:
    verdicts = [v for g in groups for v in g.verdicts]
    by_task: dict[str, tuple[int, int]] = {}
    for g in groups + resampled:
        passed, judged = by_task.get(g.environment.task.id, (0, 0))
        by_task[g.environment.task.id] = (
            passed + sum(v.passed for v in g.verdicts),
            judged + sum(v.reward is not None for v in g.verdicts),
        )
    solved = {g.environment.task.id for g in groups + resampled if g.any_passed}
    dropped: dict[str, int] = {}
    for w in written:
        if w.dropped is not None:
            dropped[w.dropped] = dropped.get(w.dropped, 0) + 1
    return RolloutSummary(
        job_id=job.job_id,
        groups=len(groups),
        samples=len(verdicts),
        passed=sum(v.passed for v in verdicts),
        failed=sum(v.failure is not None for v in verdicts),
        pass_at_1=sum(v.passed for v in verdicts) / len(verdicts) if verdicts else 0.0,
        pass_at_k=sum(g.any_passed for g in groups) / len(groups) if groups else 0.0,
        signal_groups=sum(g.has_signal for g in groups),
        resampled_groups=len(resampled),
        resampled_samples=sum(len(g.verdicts) for g in resampled),
        resampled_passed=sum(v.passed for g in resampled for v in g.verdicts),
        resampled_signal=sum(g.has_signal for g in resampled),
        written=len(written),
        written_kept=sum(w.task is not None for w in written),
        written_solved=sum(w.task is not None and w.task.id in solved for w in written),
        written_dropped=dropped,
        hinted_groups=len(hinted),
        hinted_samples=sum(len(g.verdicts) for g in hinted),
        hinted_passed=sum(v.passed for g in hinted for v in g.verdicts),
        seconds=seconds,
        by_task=by_task,
    )
