"""The events of the learning loop: experience and routing labels derived from traffic,
rollouts and their verdicts, training and proposal runs, and the contract's evaluations."""

from __future__ import annotations

from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from core.events.envelope import HASH_PATTERN, EventPayload
from core.events.turns import ChatMessage, HarnessStamp

RoutingSource = Literal["hint", "api_model", "correction", "kept", "up"]
ExperienceSource = Literal["rollout", "feedback", "edit"]
"""Where a record's answers came from: the model's own rollouts judged by a verifier
(``rollout``), the model's own answers judged by the people it served (``feedback``: a thumbs
up or down, a regenerate, a kept regeneration, a turn's live reward), or an answer someone
else wrote (``edit``: a person's correction, or the simulator's oracle giving the reference)."""


class RoutingLabelled(EventPayload):
    """Routing experience: the words of a user turn and the specialist that should answer
    them, derived by the experience builder (``streams.routing_rules``) on key ``routing``.
    ``source`` says what taught it: the user's own pick of a specialist (``hint``), a
    ``reroute`` (``correction``), an answer of another specialist kept after a regenerate
    (``kept``), or a thumbs-up on a turn the classifier routed (``up``)."""

    event_type = "RoutingLabelled"
    private_fields = ("text",)
    label_id: UUID
    turn_id: UUID
    text: str = Field(min_length=1)
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
    source: RoutingSource


class ExperienceRecorded(EventPayload):
    """v2: a record comes from a turn (``turn_id``) or from a group of rollouts
    (``rollout_group_id``), exactly one of them; kind ``group`` (v2) is a rollout group's
    answers with their rewards, for policy gradient. v3: its ``source`` (``None`` on records
    from before, whose source ``core.experience.source_of`` tells where it can)."""

    event_type = "ExperienceRecorded"
    private_fields = ("record",)
    schema_version = 3
    experience_id: UUID
    kind: Literal["sft", "preference", "trajectory", "group"]
    specialist: str
    turn_id: UUID | None
    rollout_group_id: UUID | None = None
    filter_version: str
    record: dict[str, JsonValue]
    source: ExperienceSource | None

    @model_validator(mode="after")
    def _one_source(self) -> ExperienceRecorded:
        if (self.turn_id is None) == (self.rollout_group_id is None):
            raise ValueError("a record comes from exactly one turn or one rollout group")
        if self.source == "rollout" and self.rollout_group_id is None:
            raise ValueError("a rollout record comes from a rollout group")
        if self.source not in (None, "rollout") and self.turn_id is None:
            raise ValueError(f"a {self.source} record comes from a turn")
        return self


class RolloutStep(BaseModel):
    """One step of an episode: what the model wrote and, when that was a tool call the
    episode's fresh tool state ran, the action (name, args, result, ok)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    output: str
    action: dict[str, JsonValue] | None = None


class RolloutSampled(EventPayload):
    """One sampled episode of a rollout group: the ``group_size`` samples a rollout job drew for
    one environment from the release then active. ``messages`` is the context without
    ``hint``; a hinted sample saw the hint after the prompt, in the user's message. v2:
    ``first_call``, the one kind of call a sweep let the first step make (``tool`` or
    ``tool.op``, ``core.harness.grammars.call_kinds``; ``None``: any call the harness has)."""

    event_type = "RolloutSampled"
    private_fields = ("messages", "hint", "steps")
    schema_version = 2
    rollout_id: UUID
    group_id: UUID
    job_id: UUID
    sample: int = Field(ge=0)
    group_size: int = Field(ge=1)
    environment: str = Field(min_length=1, max_length=200)
    specialist: str
    release_id: str
    adapter_version: str | None
    harness: HarnessStamp
    messages: list[ChatMessage]
    hint: str | None
    first_call: str | None = Field(max_length=200)
    seed: int = Field(ge=0)
    temperature: float = Field(ge=0.0, le=2.0)
    steps: list[RolloutStep] = Field(min_length=1)


class WrittenProposal(BaseModel):
    """One prompt a rollout job's writer proposed: kept as ``task`` (a ``core.tasks.Task``,
    its checker derived from the prompt by its family's rule), or dropped, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str = Field(min_length=1, max_length=100)
    prompt: str = Field(max_length=2000)
    task: dict[str, JsonValue] | None
    dropped: str | None = Field(max_length=100)

    @model_validator(mode="after")
    def _kept_or_dropped(self) -> WrittenProposal:
        if (self.task is None) == (self.dropped is None):
            raise ValueError("a proposal is either kept as a task or dropped with a reason")
        return self


class TasksWritten(EventPayload):
    """The tasks a rollout job wrote itself (``learners.rollouts.writing``), before it sampled
    any: each proposal of the writer (the release's ``adapter_version``, or the base model),
    kept or dropped, under ``writer_version``'s rules. The job rolls out the kept tasks beside
    the bank's; a redelivered job reads them back from here instead of writing anew."""

    event_type = "TasksWritten"
    job_id: UUID
    specialist: str
    release_id: str
    adapter_version: str | None
    writer_version: str
    proposals: list[WrittenProposal] = Field(max_length=256)


class RolloutScored(EventPayload):
    """The verifier's verdict on one sampled episode: ``reward`` in [0, 1] and ``passed``, or,
    when the verifier crashed or its reward was out of range, ``failure`` and no reward (a
    failed rollout teaches nothing)."""

    event_type = "RolloutScored"
    rollout_id: UUID
    group_id: UUID
    verifier: str
    verifier_version: str
    reward: float | None = Field(ge=0.0, le=1.0)
    passed: bool
    failure: str | None = None

    @model_validator(mode="after")
    def _reward_or_failure(self) -> RolloutScored:
        if (self.reward is None) == (self.failure is None):
            raise ValueError("a verdict has a reward or a failure, exactly one")
        if self.failure is not None and self.passed:
            raise ValueError("a failed rollout cannot pass")
        return self


class TrainingRequested(EventPayload):
    event_type = "TrainingRequested"
    run_id: UUID
    specialist: str
    parent_adapter_version: str
    snapshot_id: UUID
    recipe: str


class UnlearningRequested(EventPayload):
    """Forgetting with retraining, asked of the server (``DELETE /admin/tenants/{id}?retrain=
    true``): the runs it queued that unlearn every forgotten tenant (their own
    ``TrainingRequested`` and ``RouterTrainingRequested`` are in the log too), for the stream
    processors to hand to the workers, as the server does not import the queue; and the
    release it asked to promote where a specialist learned from forgotten tenants alone."""

    event_type = "UnlearningRequested"
    runs: list[UUID]
    router_run: UUID | None
    fallback_release_id: str | None


class RouterTrainingRequested(EventPayload):
    """Enough new routing labels: a router successor is to be trained on every label of the
    log before ``labels_end`` (with the seed examples) and judged by the routing suite.
    ``labels`` counts the new ones, or for a run that unlearns forgotten tenants the readable
    ones (0 when theirs were all there were: the seed examples alone are fitted)."""

    event_type = "RouterTrainingRequested"
    run_id: UUID
    labels: int = Field(ge=0)
    labels_end: dict[str, int]


class RouterEvaluated(EventPayload):
    """A router successor judged on the contract's routing suite against the router it would
    replace: accuracies over the suite, and why it was refused (nothing when it passed). v2
    added ``labels_left_out``: the run's labels naming a specialist its router does not know
    (skipped, never fitted; 0 on verdicts upcast from v1)."""

    event_type = "RouterEvaluated"
    schema_version = 2
    run_id: UUID
    router_version: str
    parent_router_version: str
    contract_version: str
    candidate_accuracy: float = Field(ge=0.0, le=1.0)
    parent_accuracy: float = Field(ge=0.0, le=1.0)
    passed: bool
    reasons: list[str] = Field(default_factory=list)
    labels_left_out: int = Field(default=0, ge=0)


class CandidateTrained(EventPayload):
    event_type = "CandidateTrained"
    run_id: UUID
    specialist: str
    adapter_version: str
    parent_adapter_version: str
    sha256: str = Field(pattern=HASH_PATTERN)
    metrics: dict[str, float] = Field(default_factory=dict)


class HarnessProposed(EventPayload):
    """A run proposed a harness successor (``change``: grammar, exemplars or prompt) for one
    specialist; the contract judges it next, as it judges a trained adapter."""

    event_type = "HarnessProposed"
    run_id: UUID
    specialist: str
    harness_version: str
    parent_harness_version: str
    change: str
    sha256: str = Field(pattern=HASH_PATTERN)


class ContractEvaluated(EventPayload):
    event_type = "ContractEvaluated"
    evaluation_id: UUID
    run_id: UUID
    contract_version: str
    scores: dict[str, float]
    passed: bool
