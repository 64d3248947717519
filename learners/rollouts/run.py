"""Running a rollout job (``learners.rollouts.job``) on the worker's runtime: write the job's own
tasks, sample a group of K per environment, more for flat ones up to the budget, then, with
hints, a second look at those no sample solved; every group recorded as it is sampled."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import cast, get_args

from pydantic import (
    ValidationError,
)

from core.engine import Engine
from core.errors import EventIdConflict, InvalidEvent
from core.events import (
    NewEvent,
    RolloutScored,
    TasksWritten,
    WrittenProposal,
)
from core.harness.artifact import HarnessVersion
from core.ids import derived_id
from core.release import Release
from core.tasks import Task
from infra.artifacts import load_release
from infra.postgres.registry import active_release, harness_by_name
from learners.evaluation.contract_runner import (
    held_out_tasks,
    load_contract,
    load_training_bank,
)
from learners.rollouts.environments import (
    CheckerVerifier,
    Environment,
    Verifier,
)
from learners.rollouts.episodes import Group, Sampler
from learners.rollouts.job import (
    ROLLOUT_TENANT,
    Look,
    RolloutInvalid,
    RolloutJob,
    RolloutSummary,
    flat,
    group_events,
    group_id_of,
    recorded_verdicts,
    rollout_key,
    sample_groups,
)
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

_log = logging.getLogger(__name__)


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
        groups = sample_groups(sampler, job, todo, verifier, record, Look(hinted, round_))
        return asyncio.run(groups)

    def rounds_of(upto: int) -> dict[str, list[list[RolloutScored]]]:  # one read of the log
        recorded = recorded_verdicts(rt.log, job.job_id)
        return {
            env.id: [recorded.get(group_id_of(job.job_id, env, False, r), []) for r in range(upto)]
            for env in environments
        }

    try:
        sampler = _sampler(rt, engine, release, harness, job)
        written = write_tasks(rt, job, engine, release, bank.tasks, held_out_tasks(contract))
        environments += [Environment(WRITTEN, w.task) for w in written if w.task is not None]
        groups = roll(sampler, environments, False)
        resampled: list[Group] = []
        for round_ in range(1, job.rounds):
            earlier = rounds_of(round_)
            todo = [env for env in environments if all(map(flat, earlier[env.id]))]
            resampled += roll(sampler, todo, False, round_)
        every = rounds_of(job.rounds)
        unsolved = [
            e for e in environments if e.resampled(job.hints) and not any(map(_passed, every[e.id]))
        ]
        hinted = roll(sampler, unsolved, True)
    finally:
        engine.close()
    return _summary(job, groups, resampled, hinted, written, time.monotonic() - started)


def _passed(verdicts: list[RolloutScored]) -> bool:
    return any(v.passed for v in verdicts)


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
    try:
        rt.log.append([_written_event(job, release.release_id, name, written)])
    except EventIdConflict:  # a redelivered job wrote beside the first: the first's stand
        return write_tasks(rt, job, engine, release, bank, held_out)
    return written


def _written_event(
    job: RolloutJob, release_id: str, writer: str | None, written: list[Written]
) -> NewEvent:
    """The ``TasksWritten`` of the job's proposals, with an id derived from the job."""
    proposals = [
        WrittenProposal(
            family=w.family,
            prompt=w.prompt,
            task=None if w.task is None else w.task.model_dump(mode="json"),
            dropped=w.dropped,
        )
        for w in written
    ]
    event = TasksWritten(
        job_id=job.job_id,
        specialist=job.specialist,
        release_id=release_id,
        adapter_version=writer,
        writer_version=WRITER_VERSION,
        proposals=proposals,
    )
    return NewEvent(
        payload=event,
        tenant_id=ROLLOUT_TENANT,
        key=rollout_key(job.job_id),
        event_id=derived_id("tasks-written", job.job_id),
    )


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
