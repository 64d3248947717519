"""The conversations being served: a bounded cache, rebuilt from the log on a miss, and the one
way to append to a conversation (at its next sequences, through the group committer)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from uuid import UUID

from core.auth import Principal
from core.conversation import Conversation
from core.errors import ConversationNotFound, TurnInFlight
from core.events import EventPayload, NewEvent
from core.log import EventLog
from infra import observe
from server.turns.committer import GroupCommitter


class ConversationStore:
    def __init__(
        self, log: EventLog, clock: Callable[[], datetime], max_cached: Callable[[], int]
    ) -> None:
        self.log = log
        self._clock = clock
        self._max_cached = max_cached  # read at each start: operators may change the limits
        self._committer = GroupCommitter(log)
        self._cache: OrderedDict[UUID, Conversation] = OrderedDict()
        self._answering: set[UUID] = set()

    async def get(self, principal: Principal, conversation_id: UUID) -> Conversation:
        """A conversation of this tenant (from memory, or rebuilt from the log)."""
        found = self._cache.get(conversation_id)
        if found is None:
            events = await asyncio.to_thread(lambda: list(self.log.read(key=str(conversation_id))))
            found = Conversation.replay(events)
            if found is not None:
                self.remember(found)
        if found is None or found.tenant_id != principal.tenant_id:
            raise ConversationNotFound(f"no conversation {conversation_id}")
        self._cache.move_to_end(conversation_id)
        return found

    def cached(self, conversation_id: UUID) -> Conversation | None:
        """The conversation as this server holds it, if it does (for inspection)."""
        return self._cache.get(conversation_id)

    def remember(self, conversation: Conversation) -> None:
        """Cache ``conversation``, evicting the least recently used ones not answering a turn."""
        self._cache[conversation.conversation_id] = conversation
        while len(self._cache) > self._max_cached():
            oldest = next(iter(self._cache))
            if oldest in self._answering:
                break
            del self._cache[oldest]

    @contextmanager
    def answering(self, conversation_id: UUID) -> Iterator[None]:
        """Mark the conversation as answering a turn; one turn at a time per conversation."""
        if conversation_id in self._answering:
            raise TurnInFlight(f"conversation {conversation_id} is answering another turn")
        self._answering.add(conversation_id)
        try:
            yield
        finally:
            self._answering.discard(conversation_id)

    async def append(
        self,
        conversation: Conversation,
        payloads: Sequence[EventPayload],
        *,
        correlation_id: UUID | None,
        at: datetime | None = None,
    ) -> None:
        """Append at the conversation's next sequences and apply what was stored. Any failure
        forgets the cached conversation, so the next use rebuilds it from the log."""
        base, when, headers = conversation.version, at or self._clock(), observe.carrier()
        events = [
            NewEvent(
                payload=payload,
                tenant_id=conversation.tenant_id,
                key=conversation.key,
                sequence=base + i + 1,
                correlation_id=correlation_id,
                occurred_at=when,
                trace=headers,
            )
            for i, payload in enumerate(payloads)
        ]
        try:
            with observe.tracer.start_as_current_span(
                "log.append", attributes={"macaron.events": [e.payload.event_type for e in events]}
            ):
                recorded = await self._committer.append(events)
        except BaseException:
            self._cache.pop(conversation.conversation_id, None)
            raise
        for event in recorded:
            conversation.apply(event)
