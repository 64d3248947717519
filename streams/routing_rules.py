"""Routing experience: which specialist should answer a user's words, derived by the
experience builder from the turns it joins (``RoutingLabelled`` on key ``routing``).

Rules ``routing-1`` (``routing_labels``, pure: a joined turn and an event in, the labels out):
- a typed message whose user picked a specialist (``specialist_hint``) and was answered by it:
  ``hint``; ``api_model`` when the message came through the OpenAI API, whose ``model`` field
  a program may send whatever the words (turns from before ``TurnReceived`` v7 recorded
  where they came in give ``hint``, as they did);
- a ``reroute`` (``RoutingCorrected``): the corrected turn's words to the named specialist,
  ``correction``;
- thumbs up on a turn that answered another one again with another specialist: ``kept``;
- thumbs up on a typed message the router chose the specialist for: ``up``.
A thumbs down says "not this answer", which usually judges the answer rather than the routing:
it gives no label. A GenUI interaction (``ui_event``) is not a user's words and gives none.
Ids derive from the rules' version, the turn, the source and the event, so a redelivery
re-derives the same events.
"""

from __future__ import annotations

from core.events import (
    FeedbackGiven,
    NewEvent,
    RoutingCorrected,
    RoutingLabelled,
    RoutingSource,
    TurnCompleted,
)
from core.ids import derived_id
from core.log import RecordedEvent
from core.routing import ROUTING_KEY
from infra.postgres.experience_joins import JoinedTurn

ROUTING_RULES = "routing-1"


def routing_labels(
    turn: JoinedTurn, event: RecordedEvent, replaced: JoinedTurn | None = None
) -> list[NewEvent]:
    """The labels ``event`` gives on the completed, routed ``turn`` (``replaced``: the turn it
    answered again, if any)."""
    if turn.input_kind != "text":
        return []
    payload = event.payload
    own_pick = turn.regenerates is None and turn.specialist_hint is not None
    match payload:
        case TurnCompleted() if own_pick and turn.specialist_hint == turn.specialist:
            source: RoutingSource = "api_model" if turn.front_end == "openai" else "hint"
            return [_label(turn, event, turn.specialist, source)]
        case RoutingCorrected():
            return [_label(turn, event, payload.specialist, "correction")]
        case FeedbackGiven(kind="up"):
            if replaced is not None and replaced.specialist != turn.specialist:
                return [_label(turn, event, turn.specialist, "kept")]
            if turn.regenerates is None and turn.specialist_hint is None:
                return [_label(turn, event, turn.specialist, "up")]
    return []


def _label(
    turn: JoinedTurn, event: RecordedEvent, specialist: str, source: RoutingSource
) -> NewEvent:
    label_id = derived_id(ROUTING_RULES, turn.turn_id, source, event.envelope.event_id)
    return NewEvent(
        payload=RoutingLabelled(
            label_id=label_id,
            turn_id=turn.turn_id,
            text=turn.content,
            specialist=specialist,
            source=source,
        ),
        tenant_id=turn.tenant_id,
        key=ROUTING_KEY,
        event_id=label_id,
        occurred_at=event.envelope.occurred_at,
        causation_id=event.envelope.event_id,
        correlation_id=turn.turn_id,
    )
