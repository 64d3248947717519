"""The experience builder: joins each turn's decision, context, response, actions and feedback
into ``ExperienceRecorded`` events, the training data of the learning loop, and into
``RoutingLabelled`` events, the router's (``streams.routing_rules``).

Filter rules (``experience_from``, pure: a joined turn, an event and the filter version in,
the records out), ``experience-1``:
- thumbs up: an SFT example (the context, and as target the answer, or for an agent turn that
  used tools its first tool call);
- edit: an SFT example with the user's edit as target, and a preference pair (edit chosen,
  the model's answer rejected), both of source ``edit`` (an answer the model did not write;
  every other record of a turn is ``feedback`` on the model's own answer);
- live rewards, each a ``trajectory`` record (the context, the turn's actions and answer, and a
  reward in [0, 1]; the policy gradient trains the turn's first step by it, see
  ``learners.training.train``): a completed agent turn with actions is rewarded the share of its
  actions that succeeded, a completed GenUI turn 1 if its tree was valid, else 0; thumbs down and
  ``regenerate`` reward the answer 0;
- thumbs up on a turn that answered another again (a ``regenerate``), when both were served
  by the same specialist and answered differently: a preference pair in the first turn's
  context (the kept answer chosen, the regenerated one rejected);
- rollouts: see ``streams.rollout_records``.
``experience-2``: as ``experience-1``, and a thumbs up also rewards the answer 1 (a
``trajectory`` record), so live rewards are no longer all 0 for chat and coding.
A tenant set not to teach (``TenantTrainingSet``) gives no record from then on; a turn the client
decoded its own way (``TurnReceived.decoding``) teaches routing only.
Ids are derived from the filter version, the turn and the feedback event, so a redelivery
re-derives the same events. The join state lives in PostgreSQL
(``infra.postgres.experience_joins``). The builder derives new traffic under one version
(``MACARON_EXPERIENCE_FILTER``); past traffic is derived under another by a backfill
(``streams.backfill``), with a builder of its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from uuid import UUID

from pydantic import JsonValue

from core import errors
from core.errors import HarnessNotFound
from core.events import (
    ChatMessage,
    ConversationStarted,
    ExperienceRecorded,
    ExperienceSource,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    NewEvent,
    RolloutSampled,
    RolloutScored,
    RouterDecided,
    RoutingCorrected,
    TenantForgotten,
    TenantTrainingSet,
    TurnCompleted,
    TurnReceived,
)
from core.events.privacy import Cells, DataKeys
from core.experience import (
    FILTER_VERSION,
    ExperienceRecord,
    PreferenceRecord,
    SFTRecord,
    TrajectoryRecord,
    experience_event,
    first_step,
    known_filter,
)
from core.harness.hcp import HISTORY_TURNS, build_context
from core.ids import derived_id
from core.log import RecordedEvent
from infra.postgres import experience_joins as store
from infra.postgres.db import DictConnection
from infra.postgres.erasure import erase_experience_rows
from infra.postgres.experience_joins import JoinedTurn
from streams import rollout_records
from streams.routing_rules import routing_labels

_log = logging.getLogger(__name__)


class ExperienceBuilder:
    name = "experience"
    tables: tuple[str, ...] = (
        "experience_conversations",
        "experience_turns",
        "experience_rollouts",
        "experience_tenants",
    )

    def __init__(
        self, keys: DataKeys, filter_version: str = FILTER_VERSION, *, routing: bool = True
    ) -> None:
        self.cells = Cells(keys)
        """Seals the words the join state keeps under each tenant's data key."""
        self.filter_version = known_filter(filter_version)
        self.routing = routing
        """Whether it derives routing labels too (a backfill derives experience only)."""

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        """Store the turn's facts as they arrive; on its completion and on feedback, apply the
        rules to the joined turn. A tenant forgotten since the event was read keeps nothing
        (its ``TenantForgotten`` erases what is stored)."""
        try:
            return self._handle(conn, event)
        except errors.TenantForgotten:
            return []

    def _handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        p, env, cells = event.payload, event.envelope, self.cells
        match p:
            case ConversationStarted():
                history: list[JsonValue] = [m.model_dump(mode="json") for m in p.history]
                store.record_conversation(conn, cells, p.conversation_id, env.tenant_id, history)
            case TurnReceived():
                store.record_turn(conn, cells, env, p)
            case RouterDecided():
                store.record_route(conn, p.turn_id, p.specialist, p.adapter_version)
            case HarnessActionExecuted():
                action = {"name": p.name, "args": p.args, "result": p.result, "ok": p.ok}
                store.record_action(conn, cells, env.tenant_id, p.turn_id, action)
            case GenUIRendered():
                store.record_genui(conn, p.turn_id, p.valid)
            case ModelResponded():
                store.record_response(conn, cells, env.tenant_id, p.turn_id, p.text, p.release_id)
            case TurnCompleted():
                store.record_completion(conn, p.turn_id)
                return self._derive(conn, event, p.turn_id)
            case FeedbackGiven() | RoutingCorrected():
                return self._derive(conn, event, p.turn_id)
            case TenantTrainingSet():
                store.record_training(conn, env.tenant_id, p.training)
            case TenantForgotten():
                erase_experience_rows(conn, p.tenant)
            case RolloutSampled():
                rollout_records.record_sampled(conn, event, p)
            case RolloutScored():
                return rollout_records.record_scored(conn, event, p, self.filter_version)
        return []

    def _derive(self, conn: DictConnection, event: RecordedEvent, turn_id: UUID) -> list[NewEvent]:
        try:
            turn = store.joined_turn(conn, self.cells, turn_id, HISTORY_TURNS)
            replaced = None
            if turn is not None and turn.regenerates is not None:
                replaced = store.joined_turn(conn, self.cells, turn.regenerates, HISTORY_TURNS)
        except HarnessNotFound as exc:  # its context cannot be rebuilt: nothing to learn from
            _log.warning("turn %s gives no experience: %s", turn_id, exc.message)
            return []
        if turn is None or not store.teaches(conn, turn.tenant_id):
            return []
        labels = routing_labels(turn, event, replaced) if self.routing else []
        if turn.client_decoding:  # answered in the client's format: it teaches routing only
            return labels
        return experience_from(turn, event, replaced, version=self.filter_version) + labels

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None


def experience_from(
    turn: JoinedTurn,
    event: RecordedEvent,
    replaced: JoinedTurn | None = None,
    *,
    version: str,
) -> list[NewEvent]:
    """The records a completed turn's ``TurnCompleted`` or ``FeedbackGiven`` yields under
    filter ``version``; ``replaced`` is the completed turn it answered again, if it was a
    regeneration."""
    payload = event.payload
    derived: list[ExperienceRecord] = []
    source: ExperienceSource = "feedback"
    if isinstance(payload, TurnCompleted):
        derived = _trajectory(turn)
    elif isinstance(payload, FeedbackGiven):
        if payload.kind == "edit":
            source = "edit"
        derived = _from_feedback(turn, payload)
        if payload.kind == "up":
            derived += _kept_regeneration(turn, replaced)
            if version != "experience-1" and turn.response is not None:
                derived.append(_rewarded(turn, 1.0))
    return [_record(event, turn, record, version, source) for record in derived]


def _kept_regeneration(turn: JoinedTurn, replaced: JoinedTurn | None) -> list[ExperienceRecord]:
    """The pair a kept regeneration gives, in the context the first answer had."""
    if replaced is None or replaced.response is None or replaced.specialist != turn.specialist:
        return []
    chosen = first_step(turn.actions, turn.response)
    rejected = first_step(replaced.actions, replaced.response)
    if chosen == rejected:
        return []
    pair = {
        "messages": context_messages(replaced),
        "chosen": chosen,
        "rejected": rejected,
        "adapter_version": turn.adapter_version,
        "release_id": turn.release_id,
    }
    return [PreferenceRecord.model_validate(pair)]


def context_messages(turn: JoinedTurn) -> list[dict[str, str]]:
    """The context the model had: the specialist's HCP context under the harness the turn ran
    under, history as it was."""
    history = list(turn.seed_history)
    for content, response in turn.earlier:
        history.append(ChatMessage(role="user", content=content))
        history.append(ChatMessage(role="assistant", content=response or ""))
    return build_context(turn.harness, turn.specialist, history, turn.content).messages()


def _from_feedback(turn: JoinedTurn, feedback: FeedbackGiven) -> list[ExperienceRecord]:
    if turn.response is None:
        return []
    if feedback.kind in ("down", "regenerate"):
        return [_rewarded(turn, 0.0)]
    messages = context_messages(turn)
    served = {"adapter_version": turn.adapter_version, "release_id": turn.release_id}
    if feedback.kind == "up":
        target = first_step(turn.actions, turn.response)
        return [SFTRecord.model_validate({"messages": messages, "target": target, **served})]
    if feedback.kind == "edit" and feedback.edited_text:
        edited = feedback.edited_text
        return [
            SFTRecord.model_validate({"messages": messages, "target": edited, **served}),
            PreferenceRecord.model_validate(
                {"messages": messages, "chosen": edited, "rejected": turn.response, **served}
            ),
        ]
    return []


def _trajectory(turn: JoinedTurn) -> list[ExperienceRecord]:
    if turn.actions:
        actions = turn.actions
        return [_rewarded(turn, sum(1 for a in actions if a["ok"]) / len(actions))]
    if turn.genui_valid is not None and turn.response is not None:
        return [_rewarded(turn, 1.0 if turn.genui_valid else 0.0)]
    return []


def _rewarded(turn: JoinedTurn, reward: float) -> TrajectoryRecord:
    """The turn as it ran (context, actions, answer) with a reward."""
    return TrajectoryRecord.model_validate(
        {
            "messages": context_messages(turn),
            "actions": json.loads(json.dumps(list(turn.actions))),
            "answer": turn.response,
            "reward": reward,
            "adapter_version": turn.adapter_version,
            "release_id": turn.release_id,
        }
    )


def _record(
    event: RecordedEvent,
    turn: JoinedTurn,
    record: ExperienceRecord,
    version: str,
    source: ExperienceSource,
) -> NewEvent:
    """The record as an event, caused by ``event``; its id derives from the filter version, the
    turn, the kind and ``event``."""
    experience_id = derived_id(version, turn.turn_id, record.kind, event.envelope.event_id)
    payload = ExperienceRecorded(
        experience_id=experience_id,
        kind=record.kind,
        specialist=turn.specialist,
        turn_id=turn.turn_id,
        filter_version=version,
        record=record.stored(),
        source=source,
    )
    return experience_event(payload, turn.tenant_id, event.envelope, turn.turn_id)
