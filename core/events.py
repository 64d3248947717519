"""Event catalogue v1: the envelope, the payload of every event type, and decoding.

An event is an immutable envelope (identity, ordering, provenance, hash chain) around a typed
payload. The envelope stores the payload as plain JSON at the schema version it was written with;
``decode_payload`` upcasts it to the version this code knows and validates it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from core.canonical import canonical_json, sha256_hex
from core.errors import InvalidEvent, UnknownEventType
from core.ids import uuid7
from core.upcasting import UpcasterRegistry

_HASH = r"^[0-9a-f]{64}$"
_TYPE = r"^[A-Za-z][A-Za-z0-9_.]{0,99}$"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$"


def utc_now() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must carry a time zone")
    return value.astimezone(UTC)


Name = Annotated[str, Field(pattern=_NAME)]
Hash = Annotated[str, Field(pattern=_HASH)]
UtcTime = Annotated[datetime, AfterValidator(_utc)]


@dataclass(frozen=True, slots=True)
class Envelope:
    """One stored event.

    ``hash`` = sha256(canonical JSON of every other field, with the payload replaced by
    ``payload_sha256``, its own sha256 over canonical JSON). Hashing the payload separately lets
    a writer serialise it once for both the hash and storage.

    A plain dataclass: the log builds trusted envelopes directly (cheap on replay); anything
    from outside goes through ``Envelope.validate``.
    """

    __pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)

    event_id: UUID
    type: Annotated[str, Field(pattern=_TYPE)]
    schema_version: Annotated[int, Field(ge=1)]
    occurred_at: UtcTime
    tenant_id: Name
    key: Name
    sequence: Annotated[int, Field(ge=1)]
    causation_id: UUID | None
    correlation_id: UUID | None
    trace: dict[str, str]
    prev_hash: Hash | None
    hash: Hash
    payload: dict[str, JsonValue]

    @staticmethod
    def validate(data: Any) -> Envelope:
        """Validate untrusted JSON values into an envelope (raises ``ValidationError``)."""
        return _ENVELOPE.validate_python(data)

    def header(self) -> dict[str, Any]:
        """Every field but ``hash`` and ``payload``, as JSON values."""
        return {
            "event_id": str(self.event_id),
            "type": self.type,
            "schema_version": self.schema_version,
            "occurred_at": format_time(self.occurred_at),
            "tenant_id": self.tenant_id,
            "key": self.key,
            "sequence": self.sequence,
            "causation_id": _str_or_none(self.causation_id),
            "correlation_id": _str_or_none(self.correlation_id),
            "trace": self.trace,
            "prev_hash": self.prev_hash,
        }

    def computed_hash(self) -> str:
        return chain_hash(self.header(), sha256_hex(canonical_json(self.payload)))

    def content_digest(self) -> str:
        payload_sha256 = sha256_hex(canonical_json(self.payload))
        return content_digest(
            self.type, self.schema_version, self.tenant_id, self.key, payload_sha256
        )

    def to_json(self) -> dict[str, Any]:
        """The whole envelope as JSON values."""
        return {**self.header(), "hash": self.hash, "payload": self.payload}


_ENVELOPE: TypeAdapter[Envelope] = TypeAdapter(Envelope)


def _str_or_none(value: UUID | None) -> str | None:
    return None if value is None else str(value)


def format_time(value: datetime) -> str:
    return _utc(value).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def chain_hash(header: dict[str, Any], payload_sha256: str) -> str:
    return sha256_hex(canonical_json({**header, "payload_sha256": payload_sha256}))


def content_digest(
    type: str, schema_version: int, tenant_id: str, key: str, payload_sha256: str
) -> str:
    """What makes two appends of one event id "the same event" (idempotent) or a conflict.

    The parts are joined with a unit separator, which no type, tenant or key may contain."""
    parts = (type, str(schema_version), tenant_id, key, payload_sha256)
    return sha256_hex("\x1f".join(parts).encode())


class EventPayload(BaseModel):
    """Base of every payload; each subclass names its type and current schema version."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1


@dataclass(frozen=True)
class Sealed:
    """An event fixed at its place in its key's chain, with its payload serialised once."""

    envelope: Envelope
    payload: EventPayload
    payload_json: str
    content_digest: str

    def envelope_json(self) -> bytes:
        """The envelope as JSON bytes, reusing the serialised payload."""
        head = canonical_json({**self.envelope.header(), "hash": self.envelope.hash})
        return head[:-1] + b',"payload":' + self.payload_json.encode() + b"}"


class NewEvent(BaseModel):
    """An event a writer wants appended. The log assigns sequence (unless given) and hashes.

    ``sequence``, when given, is optimistic concurrency: the event must land exactly there,
    or the append fails with ``SequenceConflict``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    payload: EventPayload
    tenant_id: str = Field(pattern=_NAME)
    key: str = Field(pattern=_NAME)
    event_id: UUID = Field(default_factory=uuid7)
    occurred_at: datetime = Field(default_factory=utc_now)
    sequence: int | None = Field(default=None, ge=1)
    causation_id: UUID | None = None
    correlation_id: UUID | None = None
    trace: dict[str, str] = Field(default_factory=dict)

    _normalise_time = field_validator("occurred_at")(_utc)

    def seal(self, sequence: int, prev_hash: str | None) -> Sealed:
        """Fix this event at ``sequence`` after ``prev_hash`` and compute its hash."""
        try:
            return self._seal(sequence, prev_hash)
        except (UnicodeEncodeError, ValueError) as exc:  # lone surrogates, NaN
            raise InvalidEvent(f"{self.payload.event_type} cannot be stored: {exc}") from exc

    def _seal(self, sequence: int, prev_hash: str | None) -> Sealed:
        payload = self.payload.model_dump(mode="json")
        payload_bytes = canonical_json(payload)
        payload_sha256 = sha256_hex(payload_bytes)
        # Every field is already validated (by this model and the payload's): built directly.
        unhashed = Envelope(
            event_id=self.event_id,
            type=self.payload.event_type,
            schema_version=self.payload.schema_version,
            occurred_at=self.occurred_at,
            tenant_id=self.tenant_id,
            key=self.key,
            sequence=sequence,
            causation_id=self.causation_id,
            correlation_id=self.correlation_id,
            trace=self.trace,
            prev_hash=prev_hash,
            hash="",
            payload=payload,
        )
        envelope = replace(unhashed, hash=chain_hash(unhashed.header(), payload_sha256))
        digest = content_digest(
            envelope.type, envelope.schema_version, self.tenant_id, self.key, payload_sha256
        )
        return Sealed(envelope, self.payload, payload_bytes.decode(), digest)


# --- conversation events ------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ConversationStarted(EventPayload):
    event_type = "ConversationStarted"
    conversation_id: UUID
    release_id: str
    title: str | None = None
    history: list[ChatMessage] = Field(default_factory=list)
    """Earlier messages a client brought with it (the OpenAI API sends them with each request),
    so the model's context can be rebuilt from the log alone."""


class HarnessStamp(BaseModel):
    """Which harness and HCP version produced a turn's event (part of the release, recorded on
    every event of the turn so an auditor needs no join)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    harness_version: str = Field(min_length=1, max_length=100)
    hcp_version: str = Field(min_length=1, max_length=100)


class RequestedDecoding(BaseModel):
    """How a client asked a turn to be decoded (the OpenAI API's parameters), over the
    specialist's harness settings; the server's ``max_new_tokens`` stays a cap. ``json``: any
    JSON value; ``json_schema``: a JSON value valid against ``json_schema`` (each enforced
    token by token, in place of the harness's grammar; a client's tool call is a
    ``json_schema`` output)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**62)
    stop: tuple[str, ...] = Field(default=(), max_length=4)
    output: Literal["json", "json_schema"] | None = None
    json_schema: dict[str, JsonValue] | None = None
    or_text: bool = False
    """With ``json_schema``: plain text is allowed instead (a client's ``tool_choice`` auto)."""

    @model_validator(mode="after")
    def _schema_for_its_output(self) -> RequestedDecoding:
        if (self.output == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required for output json_schema, and only for it")
        if self.or_text and self.output != "json_schema":
            raise ValueError("or_text goes with output json_schema")
        return self


class TurnReceived(EventPayload):
    """v2 renamed ``text`` to ``content`` and added ``client_msg_id`` and ``specialist_hint``;
    v3 added the serving release, the harness stamp (``None`` on turns upcast from before the
    harness existed) and ``input_kind`` (a typed message, or a GenUI ``ui_event``); v4 added
    ``regenerates``, the turn this one answers again (the user asked to regenerate it); v5
    added ``decoding``, what the client asked of the decoding (``None``: the harness's); v6
    added ``decoding.or_text`` (a client's tool call, or text)."""

    event_type = "TurnReceived"
    schema_version = 6
    conversation_id: UUID
    turn_id: UUID
    client_msg_id: str = Field(min_length=1, max_length=200)
    content: str
    specialist_hint: str | None = None
    input_kind: Literal["text", "ui_event"] = "text"
    release_id: str | None
    harness: HarnessStamp | None
    regenerates: UUID | None = None
    decoding: RequestedDecoding | None = None


class RouterDecided(EventPayload):
    event_type = "RouterDecided"
    turn_id: UUID
    scores: dict[str, float]
    specialist: str
    adapter_version: str
    router_version: str
    harness: HarnessStamp


class HarnessActionExecuted(EventPayload):
    event_type = "HarnessActionExecuted"
    turn_id: UUID
    action_id: UUID
    name: str
    args: dict[str, JsonValue]
    result: JsonValue
    ok: bool
    state_delta: dict[str, JsonValue] = Field(default_factory=dict)
    harness: HarnessStamp


class GenUIRendered(EventPayload):
    event_type = "GenUIRendered"
    turn_id: UUID
    tree: dict[str, JsonValue]
    valid: bool
    errors: list[str] = Field(default_factory=list)
    catalogue_version: str
    harness: HarnessStamp


class ModelResponded(EventPayload):
    event_type = "ModelResponded"
    turn_id: UUID
    release_id: str
    specialist: str
    adapter_version: str
    harness: HarnessStamp
    text: str
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class TurnCompleted(EventPayload):
    event_type = "TurnCompleted"
    turn_id: UUID
    latency_ms: float = Field(ge=0)
    time_to_first_token_ms: float | None = Field(default=None, ge=0)
    harness: HarnessStamp


class FeedbackGiven(EventPayload):
    event_type = "FeedbackGiven"
    turn_id: UUID
    kind: Literal["up", "down", "edit", "regenerate"]
    edited_text: str | None = None


class TenantTrainingSet(EventPayload):
    """Whether a tenant's traffic may teach (the envelope's tenant): from this event on, the
    experience builder derives no training or routing record from a tenant set to ``False``.
    Tenants teach until they are set otherwise."""

    event_type = "TenantTrainingSet"
    training: bool


class RoutingCorrected(EventPayload):
    """A user saying which specialist should have answered a completed turn (a ``reroute``;
    the turn is then answered again by that specialist)."""

    event_type = "RoutingCorrected"
    turn_id: UUID
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")


# --- learning events ----------------------------------------------------------------------


RoutingSource = Literal["hint", "correction", "kept", "up"]


class RoutingLabelled(EventPayload):
    """Routing experience: the words of a user turn and the specialist that should answer
    them, derived by the experience builder (``streams.routing``) on key ``routing``.
    ``source`` says what taught it: the user's own pick of a specialist (``hint``), a
    ``reroute`` (``correction``), an answer of another specialist kept after a regenerate
    (``kept``), or a thumbs-up on a turn the classifier routed (``up``)."""

    event_type = "RoutingLabelled"
    label_id: UUID
    turn_id: UUID
    text: str = Field(min_length=1)
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
    source: RoutingSource


class SpecialistAdded(EventPayload):
    """A specialist added at run time (``macaron specialist add``), on key ``specialists``: what
    it is for, and the example turns every router fit learns it from (beside the seed
    examples) while the active release's router knows it."""

    event_type = "SpecialistAdded"
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
    description: str = Field(min_length=1, max_length=500)
    examples: tuple[str, ...] = Field(min_length=1, max_length=1000)


class ExperienceRecorded(EventPayload):
    """v2: a record comes from a turn (``turn_id``) or from a group of rollouts
    (``rollout_group_id``), exactly one of them; kind ``group`` (v2) is a rollout group's
    answers with their rewards, for policy gradient."""

    event_type = "ExperienceRecorded"
    schema_version = 2
    experience_id: UUID
    kind: Literal["sft", "preference", "trajectory", "group"]
    specialist: str
    turn_id: UUID | None
    rollout_group_id: UUID | None = None
    filter_version: str
    record: dict[str, JsonValue]

    @model_validator(mode="after")
    def _one_source(self) -> ExperienceRecorded:
        if (self.turn_id is None) == (self.rollout_group_id is None):
            raise ValueError("a record comes from exactly one turn or one rollout group")
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
    ``hint``; a hinted sample saw the hint after the prompt, in the user's message."""

    event_type = "RolloutSampled"
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
    seed: int = Field(ge=0)
    temperature: float = Field(ge=0.0, le=2.0)
    steps: list[RolloutStep] = Field(min_length=1)


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


class RouterTrainingRequested(EventPayload):
    """Enough new routing labels: a router successor is to be trained on every label of the
    log before ``labels_end`` (with the seed examples) and judged by the routing suite."""

    event_type = "RouterTrainingRequested"
    run_id: UUID
    labels: int = Field(ge=1)
    labels_end: dict[str, int]


class RouterEvaluated(EventPayload):
    """A router successor judged on the contract's routing suite against the router it would
    replace: accuracies over the suite, and why it was refused (nothing when it passed)."""

    event_type = "RouterEvaluated"
    run_id: UUID
    router_version: str
    parent_router_version: str
    contract_version: str
    candidate_accuracy: float = Field(ge=0.0, le=1.0)
    parent_accuracy: float = Field(ge=0.0, le=1.0)
    passed: bool
    reasons: list[str] = Field(default_factory=list)


class CandidateTrained(EventPayload):
    event_type = "CandidateTrained"
    run_id: UUID
    specialist: str
    adapter_version: str
    parent_adapter_version: str
    sha256: str = Field(pattern=_HASH)
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
    sha256: str = Field(pattern=_HASH)


class ContractEvaluated(EventPayload):
    event_type = "ContractEvaluated"
    evaluation_id: UUID
    run_id: UUID
    contract_version: str
    scores: dict[str, float]
    passed: bool


class ReleasePromoted(EventPayload):
    event_type = "ReleasePromoted"
    release_id: str
    parent_release_id: str | None
    run_id: UUID | None = None


class PromotionRejected(EventPayload):
    event_type = "PromotionRejected"
    run_id: UUID
    reason: str


class ReleaseRolledBack(EventPayload):
    event_type = "ReleaseRolledBack"
    from_release_id: str
    to_release_id: str
    reason: str


CATALOGUE: dict[str, type[EventPayload]] = {
    cls.event_type: cls
    for cls in (
        ConversationStarted,
        TurnReceived,
        RouterDecided,
        HarnessActionExecuted,
        GenUIRendered,
        ModelResponded,
        TurnCompleted,
        FeedbackGiven,
        RoutingCorrected,
        TenantTrainingSet,
        ExperienceRecorded,
        RoutingLabelled,
        SpecialistAdded,
        RolloutSampled,
        RolloutScored,
        TrainingRequested,
        RouterTrainingRequested,
        RouterEvaluated,
        CandidateTrained,
        HarnessProposed,
        ContractEvaluated,
        ReleasePromoted,
        PromotionRejected,
        ReleaseRolledBack,
    )
}

UPCASTERS = UpcasterRegistry()


@UPCASTERS.register("TurnReceived", 1)
def _turn_received_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 had ``text`` and no client message id; the turn id stood in for it."""
    payload["content"] = payload.pop("text")
    payload.setdefault("client_msg_id", str(payload["turn_id"]))
    payload.setdefault("specialist_hint", None)
    return payload


@UPCASTERS.register("TurnReceived", 2)
def _turn_received_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 turns predate the harness: no release or harness stamp was recorded."""
    payload.setdefault("release_id", None)
    payload.setdefault("harness", None)
    return payload


@UPCASTERS.register("TurnReceived", 3)
def _turn_received_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """v3 turns were never regenerations (regenerating was not recorded as a link)."""
    payload.setdefault("regenerates", None)
    return payload


@UPCASTERS.register("TurnReceived", 4)
def _turn_received_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """v4 turns were sampled as their harness said."""
    payload.setdefault("decoding", None)
    return payload


@UPCASTERS.register("TurnReceived", 5)
def _turn_received_v5(payload: dict[str, Any]) -> dict[str, Any]:
    """v5 decodings were never a tool call or text: a client's format was enforced alone."""
    if isinstance(payload.get("decoding"), dict):
        payload["decoding"].setdefault("or_text", False)
    return payload


@UPCASTERS.register("ExperienceRecorded", 1)
def _experience_recorded_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 records all came from turns."""
    payload.setdefault("rollout_group_id", None)
    return payload


def decode_payload(envelope: Envelope) -> EventPayload:
    """Upcast and validate the payload of a stored envelope into its current typed model."""
    cls = CATALOGUE.get(envelope.type)
    if cls is None:
        raise UnknownEventType(f"unknown event type {envelope.type!r}")
    payload = UPCASTERS.upcast(
        envelope.type, envelope.schema_version, dict(envelope.payload), cls.schema_version
    )
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        raise InvalidEvent(f"{envelope.type} v{cls.schema_version}: {exc}") from exc
