"""The experience builder's join state (``experience_turns``, ``experience_conversations``):
each turn's decision, response and actions as they arrive, read back joined once the turn is
complete. What was said (a turn's message, its answer and actions, a conversation's opening
history) is stored sealed under the tenant's data key (``core.events.privacy.Cells``, migration
0022): every write and read of it takes the ``Cells``. A tenant's key destroyed, its turns no
longer join."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from pydantic import JsonValue

from core.events import ChatMessage, Envelope, TurnReceived
from core.events.privacy import Cells
from core.harness.artifact import HarnessVersion, harness_number, root_version
from infra.postgres.db import DictConnection
from infra.postgres.registry import harness_by_name


@dataclass(frozen=True)
class JoinedTurn:
    """A completed, routed turn with what the model knew when it answered: the history the
    conversation started with and the completed turns before it (oldest first)."""

    turn_id: UUID
    conversation_id: UUID
    tenant_id: str
    specialist: str
    adapter_version: str | None
    release_id: str | None
    content: str
    response: str | None
    actions: tuple[dict[str, Any], ...]
    seed_history: tuple[ChatMessage, ...]
    earlier: tuple[tuple[str, str | None], ...]
    """(user content, model response) of the completed turns before this one."""
    harness: HarnessVersion = field(default_factory=root_version)
    """The harness the turn ran under, from the registry (``harness@0`` for a turn recorded
    before the builder kept it)."""
    regenerates: UUID | None = None
    """The turn this one answered again, when the user asked to regenerate that one."""
    specialist_hint: str | None = None
    """The specialist the turn's message asked for (a user's pick, or the one a regenerate or
    a reroute named)."""
    input_kind: str = "text"
    genui_valid: bool | None = None
    """Whether the GenUI tree the turn answered with was valid (``None``: not a GenUI turn)."""
    client_decoding: bool = False
    """Whether the client asked for its own decoding (then the answer teaches no adapter)."""
    front_end: str | None = None
    """Where its words came in (``TurnReceived.front_end``; ``None``: not recorded)."""


def _place(column: str, row: UUID) -> str:
    """Where a sealed value lives: its associated data, so that it opens only there."""
    return f"{column}:{row}"


def record_conversation(
    conn: DictConnection,
    cells: Cells,
    conversation_id: UUID,
    tenant_id: str,
    history: list[JsonValue],
) -> None:
    place = _place("experience_conversations.history", conversation_id)
    conn.execute(
        "INSERT INTO experience_conversations (conversation_id, sealed_history, tenant_id) "
        "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (conversation_id, cells.seal(tenant_id, place, history), tenant_id),
    )


def record_turn(conn: DictConnection, cells: Cells, envelope: Envelope, turn: TurnReceived) -> None:
    """The turn ``envelope`` holds (its payload, ``turn``), at its place in its conversation."""
    content = cells.seal(
        envelope.tenant_id, _place("experience_turns.content", turn.turn_id), turn.content
    )
    conn.execute(
        "INSERT INTO experience_turns (turn_id, conversation_id, tenant_id, position, "
        "sealed_content, harness_version, regenerates, specialist_hint, input_kind, "
        "client_decoding, front_end) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (
            turn.turn_id,
            turn.conversation_id,
            envelope.tenant_id,
            envelope.sequence,
            content,
            None if turn.harness is None else turn.harness.harness_version,
            turn.regenerates,
            turn.specialist_hint,
            turn.input_kind,
            turn.decoding is not None,
            turn.front_end,
        ),
    )


def record_route(
    conn: DictConnection, turn_id: UUID, specialist: str, adapter_version: str | None
) -> None:
    conn.execute(
        "UPDATE experience_turns SET specialist = %s, adapter_version = %s WHERE turn_id = %s",
        (specialist, adapter_version, turn_id),
    )


def record_action(
    conn: DictConnection,
    cells: Cells,
    tenant_id: str,
    turn_id: UUID,
    action: dict[str, JsonValue],
) -> None:
    sealed = cells.seal(tenant_id, _place("experience_turns.actions", turn_id), action)
    conn.execute(
        "UPDATE experience_turns SET sealed_actions = array_append(sealed_actions, %s) "
        "WHERE turn_id = %s",
        (sealed, turn_id),
    )


def record_response(
    conn: DictConnection,
    cells: Cells,
    tenant_id: str,
    turn_id: UUID,
    text: str,
    release_id: str | None,
) -> None:
    sealed = cells.seal(tenant_id, _place("experience_turns.response", turn_id), text)
    conn.execute(
        "UPDATE experience_turns SET sealed_response = %s, release_id = %s WHERE turn_id = %s",
        (sealed, release_id, turn_id),
    )


def record_genui(conn: DictConnection, turn_id: UUID, valid: bool) -> None:
    conn.execute(
        "UPDATE experience_turns SET genui_valid = %s WHERE turn_id = %s", (valid, turn_id)
    )


def record_training(conn: DictConnection, tenant_id: str, training: bool) -> None:
    conn.execute(
        "INSERT INTO experience_tenants VALUES (%s, %s) "
        "ON CONFLICT (tenant_id) DO UPDATE SET training = EXCLUDED.training",
        (tenant_id, training),
    )


def teaches(conn: DictConnection, tenant_id: str) -> bool:
    """Whether the tenant's traffic may teach (it may, until it is set otherwise)."""
    row = conn.execute(
        "SELECT training FROM experience_tenants WHERE tenant_id = %s", (tenant_id,)
    ).fetchone()
    return True if row is None else bool(row["training"])


def teaches_now(conn: DictConnection, tenant_id: str) -> bool:
    """Whether the tenant's traffic may teach as the live builder has read it (the public
    table, whatever schema a backfill resolves names in first)."""
    row = conn.execute(
        "SELECT training FROM public.experience_tenants WHERE tenant_id = %s", (tenant_id,)
    ).fetchone()
    return True if row is None else bool(row["training"])


def training_consent(conn: DictConnection) -> list[tuple[str, bool]]:
    """Every tenant with a key, and whether its traffic teaches (as the builder has read it)."""
    rows = conn.execute(
        "SELECT t.tenant_id, COALESCE(e.training, true) AS training FROM tenants t "
        "LEFT JOIN experience_tenants e USING (tenant_id) ORDER BY t.tenant_id"
    ).fetchall()
    return [(row["tenant_id"], bool(row["training"])) for row in rows]


def tenant_exists(conn: DictConnection, tenant_id: str) -> bool:
    row = conn.execute("SELECT 1 FROM tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
    return row is not None


def record_completion(conn: DictConnection, turn_id: UUID) -> None:
    conn.execute("UPDATE experience_turns SET completed = true WHERE turn_id = %s", (turn_id,))


def joined_turn(
    conn: DictConnection, cells: Cells, turn_id: UUID, history_turns: int
) -> JoinedTurn | None:
    """The turn joined with its history window of ``history_turns`` completed turns, or
    ``None`` while it is not complete or not routed, and once its words or its context's no
    longer open (its tenant forgotten, or recorded before the join state was sealed: migration
    0022 dropped those words, and a context without them is not the one the model saw)."""
    row = conn.execute(
        "SELECT t.*, c.sealed_history, c.conversation_id IS NOT NULL AS recorded_start, "
        "  (SELECT COALESCE(jsonb_agg(jsonb_build_array(e.turn_id, e.sealed_content, "
        "                                               e.sealed_response) "
        "                             ORDER BY e.position), '[]') "
        "   FROM (SELECT turn_id, sealed_content, sealed_response, position "
        "         FROM experience_turns "
        "         WHERE conversation_id = t.conversation_id AND position < t.position "
        "         AND completed ORDER BY position DESC LIMIT %s) AS e) AS earlier "
        "FROM experience_turns t "
        "LEFT JOIN experience_conversations c USING (conversation_id) "
        "WHERE t.turn_id = %s AND t.completed AND t.specialist IS NOT NULL",
        (history_turns, turn_id),
    ).fetchone()
    if row is None:
        return None
    words = _opened_words(cells, row)
    if words is None:
        return None
    content, response, actions, history, earlier = words
    return JoinedTurn(
        turn_id=row["turn_id"],
        conversation_id=row["conversation_id"],
        tenant_id=row["tenant_id"],
        specialist=row["specialist"],
        adapter_version=row["adapter_version"],
        release_id=row["release_id"],
        content=content,
        response=response,
        actions=actions,
        seed_history=history,
        earlier=earlier,
        harness=_harness(conn, row["harness_version"]),
        regenerates=row["regenerates"],
        specialist_hint=row["specialist_hint"],
        input_kind=row["input_kind"],
        genui_valid=row["genui_valid"],
        client_decoding=row["client_decoding"],
        front_end=row["front_end"],
    )


_Words = tuple[
    str,
    str | None,
    tuple[dict[str, Any], ...],
    tuple[ChatMessage, ...],
    tuple[tuple[str, str | None], ...],
]


def _opened_words(cells: Cells, row: dict[str, Any]) -> _Words | None:
    """A joined row's words, opened: its message, answer, actions, the conversation's opening
    history and the earlier turns' (message, answer); ``None`` once its tenant's key is gone."""
    tenant, turn = row["tenant_id"], row["turn_id"]

    def opened(column: str, row_id: UUID, stored: str | None, *, kept: bool = False) -> Any:
        """The cell opened; ``None`` where nothing was stored, unless the words were ``kept``
        there (then they were dropped by migration 0022)."""
        if stored is None:
            if kept:
                raise _Unreadable
            return None
        value = cells.open(tenant, _place(column, row_id), stored)
        if value is None:
            raise _Unreadable
        return value

    conversation = row["conversation_id"]
    try:
        content = opened("experience_turns.content", turn, row["sealed_content"], kept=True)
        response = opened("experience_turns.response", turn, row["sealed_response"])
        actions = tuple(opened("experience_turns.actions", turn, a) for a in row["sealed_actions"])
        history = opened(
            "experience_conversations.history",
            conversation,
            row["sealed_history"],
            kept=row["recorded_start"],
        )
        earlier = tuple(
            (
                opened("experience_turns.content", UUID(e_turn), e_content, kept=True),
                opened("experience_turns.response", UUID(e_turn), e_response),
            )
            for e_turn, e_content, e_response in row["earlier"]
        )
    except _Unreadable:
        return None
    seed = tuple(ChatMessage.model_validate(m) for m in history or [])
    return content, response, actions, seed, earlier


class _Unreadable(Exception):
    """A cell whose tenant's key is destroyed, or whose words migration 0022 dropped: the
    turn cannot be joined."""


def _harness(conn: DictConnection, name: str | None) -> HarnessVersion:
    """The harness a turn's stamp names: ``harness@0`` is the code's ``root_harness()`` (its
    address is pinned by a test), so it needs no registry; a turn without a stamp predates
    harness versions and ran under it. Any other version comes from the registry."""
    if name is None or harness_number(name) == 0:
        return root_version()
    return harness_by_name(conn, name)
