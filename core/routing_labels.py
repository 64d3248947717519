"""Routing experience as training examples: the labels of the log (``RoutingLabelled``),
each turn's latest, weighed by who gave it; what a router fit covers; and the port the router
service and the learning loop train router versions through (``RouterTrainer``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from core.events import RoutingLabelled, RoutingSource, SpecialistAdded
from core.routing import RouterModel, SpecialistName


class LabelledTurn(BaseModel):
    """One training example for the router; ``weight`` scales its share of its specialist."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    text: str = Field(min_length=1)
    specialist: SpecialistName
    weight: float = Field(default=1.0, gt=0.0)


class FollowUp(LabelledTurn):
    """A message after a turn that ``previous`` answered (``previous_text`` said), and where it
    belongs: with ``previous`` (a follow-up) or elsewhere (a change of subject)."""

    previous: SpecialistName
    previous_text: str = Field(min_length=1)


CORRECTING: frozenset[RoutingSource] = frozenset({"correction", "kept"})
"""Label sources where a user said the router was wrong (weighed by ``correction_weight``)."""
API_MODEL_WEIGHT = 0.25  # an API client's fixed ``model`` field, whatever its words
_WEIGHTS: dict[str, float] = {"hint": 1.0, "up": 1.0, "api_model": API_MODEL_WEIGHT}


def labels_of(
    labels: Iterable[RoutingLabelled], *, correction_weight: float = 1.0
) -> list[LabelledTurn]:
    """The training examples routing experience gives (``streams.routing_rules`` derives it
    from the log), in the order of each turn's latest label: a turn's latest label wins, a
    correction or a kept answer of another specialist weighs ``correction_weight``, and an API
    client's ``model`` field ``API_MODEL_WEIGHT``."""
    latest: dict[UUID, RoutingLabelled] = {}
    for label in labels:
        latest.pop(label.turn_id, None)
        latest[label.turn_id] = label
    return [
        LabelledTurn(
            text=label.text,
            specialist=label.specialist,
            weight=correction_weight if label.source in CORRECTING else _WEIGHTS[label.source],
        )
        for label in latest.values()
    ]


class RouterFit(BaseModel):
    """What a router fit covers: its specialists, in order (the active router's, with one added
    or one left out), and the example turns of those added at run time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    specialists: tuple[SpecialistName, ...] = Field(min_length=1)
    added: dict[SpecialistName, tuple[str, ...]] = Field(default_factory=dict)


def added_examples(events: Iterable[SpecialistAdded]) -> dict[str, tuple[str, ...]]:
    """Each specialist added at run time with its example turns (the latest addition of a name
    wins: one added again after its release was refused)."""
    return {event.specialist: event.examples for event in events}


class RouterTrainer(Protocol):
    """What the learning loop and the router service need to train and judge router versions
    (the composition root hands them ``learners.routing.training.ClassifierTrainer``, on the
    seed examples)."""

    def retrain(self, labels: Iterable[RoutingLabelled], fit: RouterFit) -> RouterModel:
        """A classifier of ``fit``'s specialists, fitted on their seed and added examples and
        on ``labels`` (those of other specialists left out)."""
        ...

    def outcomes(self, model: RouterModel, turns: Sequence[LabelledTurn]) -> dict[str, list[bool]]:
        """Per specialist, whether each of its ``turns`` (in order) is routed to it by
        ``model`` (every specialist of the model active)."""
        ...
