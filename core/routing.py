"""Routing policy: which specialist answers a user turn.

Pure: features (``core.router_features``), the active specialists and the turn's context go in,
a decision comes out. The classifier is data (one weight row and bias per specialist), so a
logged decision can be recomputed from its turn, context and router version. Routing's errors
(``RoutingError`` and its kinds) live here too; ``core.routing_labels`` turns routing experience
into training examples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from operator import mul
from typing import Annotated, Literal, Self
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.canonical import canonical_json, sha256_hex
from core.errors import MacaronError
from core.events import (
    HarnessStamp,
    RouterDecided,
    RoutingReason,
)
from core.router_features import WORD_BUCKETS, extra_features


class RoutingError(MacaronError):
    """The router cannot decide or train with what it was given."""

    code = "routing_error"


class InvalidFeatures(RoutingError):
    """A feature vector has the wrong dimension for the router, or a value that is not finite."""

    code = "invalid_features"


class NoActiveSpecialist(RoutingError):
    """Every specialist is switched off, so no turn can be routed."""

    code = "no_active_specialist"


class UnknownSpecialist(RoutingError):
    """A specialist is named that the router's classifier does not know."""

    code = "unknown_specialist"


class InvalidSpecialistName(RoutingError):
    """A specialist name that cannot also name an adapter (``coding`` in ``coding@7``)."""

    code = "invalid_specialist_name"


class SpecialistExists(RoutingError):
    """A specialist is added under a name that exists already, or enabled while enabled."""

    code = "specialist_exists"


class SpecialistRequired(RoutingError):
    """A specialist that cannot be disabled: the harness's fallback, or the last one enabled."""

    code = "specialist_required"


class ExamplesInvalid(RoutingError):
    """A specialist's examples file is not JSON lines of ``{"text": ...}`` objects."""

    code = "examples_invalid"


class InsufficientTrainingData(RoutingError):
    """Training the router needs at least one example for every specialist it knows."""

    code = "insufficient_training_data"


class RouterNotFound(RoutingError):
    """A release names a router version the registry does not hold."""

    code = "router_not_found"


class RouterInvalid(RoutingError):
    """A stored router version no longer matches its content hash."""

    code = "router_invalid"


SPECIALIST_PATTERN = r"^[a-z][a-z0-9_-]{0,63}$"
"""The specialist part of an adapter name (``coding`` in ``coding@7``)."""

DEFAULT_SPECIALISTS = ("chat", "agent", "coding", "genui")

SpecialistName = Annotated[str, Field(pattern=SPECIALIST_PATTERN)]

_SPECIALIST = re.compile(SPECIALIST_PATTERN)
_SCORE_TOLERANCE = 1e-6
# The turn's context (``decide``), measured in ``docs/serving.md`` ("Client tools", "Follow-ups").
CLEARLY_OTHER = 0.6  # with client tools, a tool caller unless another is at least this probable
FOLLOW_UP_WORDS = 6  # a message this short reads as a follow-up of the previous turn ...
FOLLOW_UP_CLEAR = 0.7  # ... and stays with its specialist unless another is at least this

ROUTING_KEY = "routing"
"""The log key of routing labels (``RoutingLabelled``)."""
ROUTER_RUNS_KEY = "training.router"
"""The log key of router runs (``RouterTrainingRequested``, ``RouterEvaluated``)."""
SPECIALISTS_KEY = "specialists"
"""The log key of specialists added at run time (``SpecialistAdded``)."""


def specialist_name(name: str) -> str:
    """``name`` if it can name a specialist (and so an adapter), else ``InvalidSpecialistName``."""
    if not _SPECIALIST.fullmatch(name):
        raise InvalidSpecialistName(
            f"invalid specialist name {name!r}: lower-case letters, digits, '_' or '-', "
            "starting with a letter, at most 64 characters"
        )
    return name


class WordsHead(BaseModel):
    """A schema-3 router's first stage: ``logit[s] = weights[s] . words + bias[s]`` over the
    turn's hashed words alone; it decides a turn when its best specialist reaches ``clear``
    (``core.router_cascade``), at least ``FOLLOW_UP_CLEAR`` (and so ``CLEARLY_OTHER``): a
    turn it decides is one the context rules would leave with its best specialist."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    weights: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...]
    clear: float = Field(ge=FOLLOW_UP_CLEAR, lt=1.0)

    @model_validator(mode="after")
    def _shape(self) -> Self:
        if len(self.weights) != len(self.bias):
            raise ValueError("the words head needs one weight row and one bias per specialist")
        if any(len(row) != WORD_BUCKETS for row in self.weights):
            raise ValueError(f"the words head's rows have {WORD_BUCKETS} weights")
        return self


class RouterModel(BaseModel):
    """A trained router classifier: ``logit[s] = weights[s] . features + bias[s]``, over the
    features of its ``schema_version`` (``core.router_features``; stored models without one
    are schema 1, and an unknown one does not validate). Schema 3 has a ``words`` head that
    decides the turns it is clear about first (``core.router_cascade.route_text``).

    ``version`` is a content hash of everything that determines decisions (specialists, weights,
    bias, schema) and of the training data's digest, so it changes whenever retraining changes
    anything, and a stored model that was altered no longer validates.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    specialists: tuple[SpecialistName, ...] = Field(min_length=1)
    weights: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...]
    training_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    schema_version: Literal[1, 2, 3] = 1
    words: WordsHead | None = None
    version: str

    @classmethod
    def create(
        cls,
        specialists: Sequence[str],
        weights: Sequence[Sequence[float]],
        bias: Sequence[float],
        training_digest: str,
        schema_version: Literal[1, 2, 3] = 1,
        words: WordsHead | None = None,
    ) -> RouterModel:
        """Build a model and stamp it with its content version."""
        rows = tuple(tuple(float(w) for w in row) for row in weights)
        biases = tuple(float(b) for b in bias)
        version = model_version(
            tuple(specialists), rows, biases, training_digest, schema_version, words
        )
        return cls(
            specialists=tuple(specialists),
            weights=rows,
            bias=biases,
            training_digest=training_digest,
            schema_version=schema_version,
            words=words,
            version=version,
        )

    @property
    def dim(self) -> int:
        """Length of the feature vectors this model scores."""
        return len(self.weights[0])

    @property
    def embedding_dim(self) -> int:
        """Length of the sentence embeddings its features begin with."""
        return self.dim - extra_features(self.schema_version)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        n = len(self.specialists)
        if len(set(self.specialists)) != n:
            raise ValueError("specialists must be unique")
        if len(self.weights) != n or len(self.bias) != n:
            raise ValueError(f"need one weight row and one bias per specialist ({n})")
        if not self.weights[0] or any(len(row) != len(self.weights[0]) for row in self.weights):
            raise ValueError("weight rows must be non-empty and of one length")
        if self.embedding_dim < 1:
            raise ValueError(f"schema {self.schema_version} takes more than {self.dim} features")
        if (self.words is not None) != (self.schema_version == 3):
            raise ValueError("a router has a words head exactly when it is of schema 3")
        if self.words is not None and len(self.words.bias) != n:
            raise ValueError(f"the words head needs one row per specialist ({n})")
        expected = model_version(
            self.specialists,
            self.weights,
            self.bias,
            self.training_digest,
            self.schema_version,
            self.words,
        )
        if self.version != expected:
            raise ValueError(f"version {self.version!r} does not match the content ({expected})")
        return self


def model_version(
    specialists: tuple[str, ...],
    weights: tuple[tuple[float, ...], ...],
    bias: tuple[float, ...],
    training_digest: str,
    schema_version: int,
    words: WordsHead | None = None,
) -> str:
    """``router-`` and the first 12 hex digits of the sha256 over the model's canonical JSON
    (schema 1 unnamed, so versions stored before schemas existed still match)."""
    content: dict[str, object] = {
        "specialists": list(specialists),
        "weights": [list(row) for row in weights],
        "bias": list(bias),
        "training_digest": training_digest,
    }
    if schema_version != 1:
        content["schema_version"] = schema_version
    if words is not None:
        content["words"] = words.model_dump(mode="json")
    return "router-" + sha256_hex(canonical_json(content))[:12]


class RouterDecision(BaseModel):
    """The specialist chosen for one turn, and why.

    ``scores`` holds the classifier's probability for every active specialist (they sum to 1),
    also when a hint overrode it, so the log shows what the classifier would have done.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    scores: dict[SpecialistName, Annotated[float, Field(ge=0.0, le=1.0)]] = Field(min_length=1)
    specialist: SpecialistName
    reason: RoutingReason
    router_version: str = Field(min_length=1)
    tool_callers: tuple[SpecialistName, ...] = ()
    """The context the decision used: the specialists that call tools, when the request
    carried client tools..."""
    previous: SpecialistName | None = None
    """... and the specialist of the conversation's previous turn, when the message was a short
    follow-up."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.specialist not in self.scores:
            raise ValueError(f"the chosen specialist {self.specialist!r} has no score")
        total = math.fsum(self.scores.values())
        if abs(total - 1.0) > _SCORE_TOLERANCE:
            raise ValueError(f"scores must sum to 1, not {total}")
        return self

    def to_event(self, turn_id: UUID, adapter_version: str, harness: HarnessStamp) -> RouterDecided:
        """The ``RouterDecided`` payload, once the serving release names the adapter version."""
        return RouterDecided(
            harness=harness,
            turn_id=turn_id,
            scores=dict(self.scores),
            specialist=self.specialist,
            adapter_version=adapter_version,
            router_version=self.router_version,
            reason=self.reason,
            tool_callers=list(self.tool_callers),
            previous=self.previous,
        )


def decide(
    features: Sequence[float],
    model: RouterModel,
    active: Collection[str],
    hint: str | None = None,
    tool_callers: Collection[str] = (),
    previous: str | None = None,
) -> RouterDecision:
    """Choose one of the ``active`` specialists for a turn with these ``features``.

    A lone active specialist is chosen outright; otherwise a hint naming an active specialist
    wins (one naming an inactive or unknown specialist is ignored: clients cannot revive a
    specialist an operator switched off); otherwise the most probable one (ties go to the
    earlier specialist of the model), unless it is unclear and the context says otherwise:
    with client tools (``tool_callers``: the specialists that call tools), the most probable
    of them, below ``CLEARLY_OTHER``; for a short follow-up (``following``), ``previous``
    (the specialist of the conversation's previous turn), below ``FOLLOW_UP_CLEAR``.
    """
    _check(features, model, active)
    candidates = [i for i, name in enumerate(model.specialists) if name in active]
    logits = [sum(map(mul, model.weights[i], features)) + model.bias[i] for i in candidates]
    return decision_from_logits(model, candidates, logits, hint, tool_callers, previous)


def decision_from_logits(
    model: RouterModel,
    candidates: list[int],
    logits: list[float],
    hint: str | None,
    tool_callers: Collection[str],
    previous: str | None,
) -> RouterDecision:
    probabilities = _softmax(logits)
    scores = {model.specialists[i]: p for i, p in zip(candidates, probabilities, strict=True)}
    callers = tuple(name for name in model.specialists if name in tool_callers)

    reason: RoutingReason
    if len(candidates) == 1:
        chosen, reason = model.specialists[candidates[0]], "only_specialist"
    elif hint is not None and hint in scores:
        chosen, reason = hint, "hint"
    else:
        best = max(range(len(candidates)), key=lambda k: (logits[k], -k))
        chosen, reason = _in_context(model.specialists[candidates[best]], scores, callers, previous)
    return RouterDecision(
        scores=scores,
        specialist=chosen,
        reason=reason,
        router_version=model.version,
        tool_callers=callers,
        previous=previous,
    )


def _check(features: Sequence[float], model: RouterModel, active: Collection[str]) -> None:
    check_active(model, active)
    if len(features) != model.dim:
        raise InvalidFeatures(
            f"router {model.version} takes {model.dim} features, not {len(features)}"
        )
    if not all(math.isfinite(x) for x in features):
        raise InvalidFeatures("feature vector holds a value that is not a finite number")


def check_active(model: RouterModel, active: Collection[str]) -> None:
    if not active:
        raise NoActiveSpecialist("no specialist is active: the router has nothing to choose")
    unknown = sorted(set(active).difference(model.specialists))
    if unknown:
        raise UnknownSpecialist(
            f"active specialists {unknown} are unknown to router {model.version}; "
            "retrain it with examples for them"
        )


def _in_context(
    best: str, scores: dict[str, float], callers: tuple[str, ...], previous: str | None
) -> tuple[str, RoutingReason]:
    """The classifier's ``best``, unless it is unclear and the context says otherwise."""
    active_callers = [name for name in callers if name in scores]
    if active_callers and best not in active_callers and scores[best] < CLEARLY_OTHER:
        return max(active_callers, key=lambda name: scores[name]), "client_tools"
    if previous in scores and previous != best and scores[best] < FOLLOW_UP_CLEAR:
        return previous, "follow_up"
    return best, "classifier"


def following(text: str, previous: str | None) -> str | None:
    """``previous`` (the specialist of the conversation's previous turn) when the message is
    short enough to read as its follow-up, else ``None``: the context ``decide`` reads."""
    return previous if len(text.split()) <= FOLLOW_UP_WORDS else None


def _softmax(logits: Sequence[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]
