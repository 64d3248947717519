"""The experience builder: joins each turn's decision, context, response, actions and feedback
into ``ExperienceRecorded`` events, the training data of the learning loop.

Filter rules ``experience-1``:
- thumbs up: an SFT example (the context, and as target the answer, or for an agent turn that
  used tools its first tool call);
- edit: an SFT example with the user's edit as target, and a preference pair (edit chosen,
  the model's answer rejected);
- a completed agent turn with actions: a trajectory whose reward is the share of actions
  that succeeded;
- thumbs down and regenerate teach nothing on their own in this version.
Ids are derived from the filter version, the turn and the feedback event, so a redelivery
re-derives the same events.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from psycopg.types.json import Jsonb
from pydantic import JsonValue

from core.events import (
    ChatMessage,
    ConversationStarted,
    ExperienceRecorded,
    FeedbackGiven,
    HarnessActionExecuted,
    ModelResponded,
    NewEvent,
    RouterDecided,
    TurnCompleted,
    TurnReceived,
)
from core.experience import FILTER_VERSION, experience_key
from core.harness.hcp import HISTORY_TURNS, build_context
from core.ids import derived_id
from core.log import RecordedEvent
from infra.postgres.db import DictConnection


class ExperienceBuilder:
    name = "experience-1"
    tables: tuple[str, ...] = ("experience_conversations", "experience_turns")

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        p, env = event.payload, event.envelope
        match p:
            case ConversationStarted():
                history = [m.model_dump() for m in p.history]
                conn.execute(
                    "INSERT INTO experience_conversations VALUES (%s, %s) ON CONFLICT DO NOTHING",
                    (p.conversation_id, Jsonb(history)),
                )
            case TurnReceived():
                conn.execute(
                    "INSERT INTO experience_turns (turn_id, conversation_id, tenant_id, "
                    "position, content) VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (p.turn_id, p.conversation_id, env.tenant_id, env.sequence, p.content),
                )
            case RouterDecided():
                conn.execute(
                    "UPDATE experience_turns SET specialist = %s, adapter_version = %s "
                    "WHERE turn_id = %s",
                    (p.specialist, p.adapter_version, p.turn_id),
                )
            case HarnessActionExecuted():
                action = {"name": p.name, "args": p.args, "result": p.result, "ok": p.ok}
                conn.execute(
                    "UPDATE experience_turns SET actions = actions || %s WHERE turn_id = %s",
                    (Jsonb([action]), p.turn_id),
                )
            case ModelResponded():
                conn.execute(
                    "UPDATE experience_turns SET response = %s, release_id = %s WHERE turn_id = %s",
                    (p.text, p.release_id, p.turn_id),
                )
            case TurnCompleted():
                conn.execute(
                    "UPDATE experience_turns SET completed = true WHERE turn_id = %s",
                    (p.turn_id,),
                )
                return self._trajectory(conn, event)
            case FeedbackGiven():
                return self._from_feedback(conn, event, p)
        return []

    def _turn(self, conn: DictConnection, turn_id: object) -> dict[str, Any] | None:
        row = conn.execute(
            "SELECT * FROM experience_turns WHERE turn_id = %s AND completed", (turn_id,)
        ).fetchone()
        return None if row is None or row["specialist"] is None else dict(row)

    def _messages(self, conn: DictConnection, turn: dict[str, Any]) -> list[dict[str, str]]:
        """The context the model had: the specialist's HCP context, history as it was."""
        seed = conn.execute(
            "SELECT history FROM experience_conversations WHERE conversation_id = %s",
            (turn["conversation_id"],),
        ).fetchone()
        earlier = conn.execute(
            "SELECT content, response FROM experience_turns WHERE conversation_id = %s "
            "AND position < %s AND completed ORDER BY position DESC LIMIT %s",
            (turn["conversation_id"], turn["position"], HISTORY_TURNS),
        ).fetchall()
        history = [ChatMessage.model_validate(m) for m in (seed["history"] if seed else [])]
        for row in reversed(earlier):
            history.append(ChatMessage(role="user", content=row["content"]))
            history.append(ChatMessage(role="assistant", content=row["response"] or ""))
        return build_context(turn["specialist"], history, turn["content"]).messages()

    def _record(
        self, event: RecordedEvent, turn: dict[str, Any], kind: str, record: dict[str, JsonValue]
    ) -> NewEvent:
        experience_id = derived_id(FILTER_VERSION, turn["turn_id"], kind, event.envelope.event_id)
        payload = ExperienceRecorded(
            experience_id=experience_id,
            kind=kind,  # type: ignore[arg-type]  # one of the three kinds, chosen by the caller
            specialist=turn["specialist"],
            turn_id=turn["turn_id"],
            filter_version=FILTER_VERSION,
            record={
                **record,
                "adapter_version": turn["adapter_version"],
                "release_id": turn["release_id"],
            },
        )
        return NewEvent(
            payload=payload,
            tenant_id=turn["tenant_id"],
            key=experience_key(turn["specialist"]),
            event_id=payload.experience_id,
            causation_id=event.envelope.event_id,
            correlation_id=turn["turn_id"],
            occurred_at=event.envelope.occurred_at,
        )

    def _from_feedback(
        self, conn: DictConnection, event: RecordedEvent, feedback: FeedbackGiven
    ) -> list[NewEvent]:
        turn = self._turn(conn, feedback.turn_id)
        if turn is None or turn["response"] is None:
            return []
        messages: Any = self._messages(conn, turn)
        if feedback.kind == "up":
            target = self._first_step(turn)
            return [self._record(event, turn, "sft", {"messages": messages, "target": target})]
        if feedback.kind == "edit" and feedback.edited_text:
            edited = feedback.edited_text
            return [
                self._record(event, turn, "sft", {"messages": messages, "target": edited}),
                self._record(
                    event,
                    turn,
                    "preference",
                    {"messages": messages, "chosen": edited, "rejected": turn["response"]},
                ),
            ]
        return []

    @staticmethod
    def _first_step(turn: dict[str, Any]) -> str:
        """What the model answered to the context first: the tool call it made, when it made
        one (the context of a record is the turn's start, so that is the step to teach)."""
        if turn["actions"]:
            first = turn["actions"][0]
            return json.dumps({"tool": first["name"], "args": first["args"]})
        return str(turn["response"])

    def _trajectory(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        turn_id = event.payload.turn_id  # type: ignore[attr-defined]
        turn = self._turn(conn, turn_id)
        if turn is None or not turn["actions"]:
            return []
        actions = turn["actions"]
        reward = sum(1 for a in actions if a["ok"]) / len(actions)
        messages: Any = self._messages(conn, turn)
        record: dict[str, JsonValue] = {
            "messages": messages,
            "actions": json.loads(json.dumps(actions)),
            "answer": turn["response"],
            "reward": reward,
        }
        return [self._record(event, turn, "trajectory", record)]

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None
