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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from uuid import UUID

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from core.errors import MacaronError
from core.events import (
    ChatMessage,
    NewEvent,
    RolloutSampled,
    RolloutScored,
)
from core.harness.artifact import HarnessVersion
from core.harness.grammars import call_kinds
from core.harness.hcp import build_context
from core.ids import derived_id
from core.log import EventLog
from core.release import Release
from core.routing import SpecialistName
from learners.evaluation.contract_runner import (
    CONCURRENCY,
)
from learners.rollouts.environments import (
    Environment,
    HintMode,
    Verifier,
    judge,
)
from learners.rollouts.episodes import Group, Sampler

ROLLOUT_TENANT = "system"


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


@dataclass(frozen=True)
class Look:
    """Which groups are sampled: the first (round 0), a later round of adaptive sampling, or
    the second look with help (``hinted``: a hint or a sweep)."""

    hinted: bool = False
    round: int = 0


FIRST = Look()


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
    look: Look = FIRST,
) -> list[Group]:
    """Every environment's K episodes at once (the engine batches them, at most ``CONCURRENCY``
    requests in flight), as ``look`` says; as each group is sampled, its verdicts and
    ``record`` (both may block: they run in a thread, one group at a time), so what a job did
    survives a crash."""
    slots, recording = asyncio.Semaphore(CONCURRENCY), asyncio.Lock()
    hinted, round_ = look.hinted, look.round

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
