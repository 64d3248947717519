"""The parts of the turn service on their own: hold-back, the rate limiter, the conversation
store (cache, eviction, one turn at a time, two writers on one conversation)."""

from __future__ import annotations

import asyncio
import uuid

import limits.storage.memory
import pytest

from core.conversation import Conversation
from core.errors import (
    ConversationNotFound,
    RateLimited,
    RateLimitUnavailable,
    SequenceConflict,
    TurnInFlight,
)
from core.events import ConversationStarted, TurnReceived, utc_now
from infra.memory import InMemoryEventLog
from server.turns import rate
from server.turns.conversations import ConversationStore
from server.turns.generation import HoldBack
from server.turns.rate import TurnRateLimiter
from tests.unit.test_turns import principal


def test_hold_back_streams_text_and_holds_json_until_judged() -> None:
    text = HoldBack(("text",))
    assert [text.delta("Hi"), text.delta("Hi there"), text.delta("Hi there")] == [
        "Hi",
        " there",
        "",
    ]
    assert text.released("Hi there") == ""

    agent = HoldBack(("text", "tool_call"))
    assert agent.delta("  ") == ""  # undecided until something visible comes
    assert agent.delta('  {"tool"') == ""
    assert agent.released('  {"tool": "clock", "args": {}}') == ""  # a call: never shown
    json_answer = HoldBack(("text", "tool_call"))
    json_answer.delta("{")
    assert json_answer.released('{"not": "a call"}') == '{"not": "a call"}'

    genui = HoldBack(("genui",))
    assert genui.delta("plain") == "" and genui.released("plain") == ""


class Clock:
    """A clock the test moves (``limits``' memory storage and the limiter read ``time.time``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def test_the_rate_limit_is_a_moving_minute_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(limits.storage.memory, "time", clock)
    monkeypatch.setattr(rate, "time", clock)
    limiter = TurnRateLimiter(lambda: 2)
    key, other = uuid.uuid4(), uuid.uuid4()
    limiter.check(key)
    clock.now += 30
    limiter.check(key)
    limiter.room(other)  # room counts nothing
    with pytest.raises(RateLimited, match="at most 2 turns a minute per key; retry in 30 s"):
        limiter.room(key)
    with pytest.raises(RateLimited):
        limiter.check(key)
    limiter.check(other)
    limiter.check(other)
    clock.now += 31  # the first turn left the window, the second not yet
    limiter.check(key)
    with pytest.raises(RateLimited):
        limiter.check(key)


def test_an_unreachable_redis_refuses_the_turn_as_unavailable() -> None:
    limiter = TurnRateLimiter(lambda: 2, "redis://127.0.0.1:1/0")  # nothing listens there
    with pytest.raises(RateLimitUnavailable) as refused:
        limiter.check(uuid.uuid4())
    assert (refused.value.code, refused.value.retryable) == ("unavailable", True)


def started(conversation: Conversation) -> ConversationStarted:
    return ConversationStarted(conversation_id=conversation.conversation_id, release_id="r1")


def received(conversation: Conversation, msg: str) -> TurnReceived:
    return TurnReceived(
        conversation_id=conversation.conversation_id,
        turn_id=uuid.uuid4(),
        client_msg_id=msg,
        content="hi",
        release_id="r1",
        harness=None,
    )


def test_the_cache_evicts_the_oldest_conversation_not_answering() -> None:
    store = ConversationStore(InMemoryEventLog(), utc_now, lambda: 2)
    a, b, c = (Conversation(uuid.uuid4(), "tenant-a") for _ in range(3))
    store.remember(a)
    with store.answering(a.conversation_id):
        store.remember(b)
        store.remember(c)  # a is answering: kept, over the bound
        assert store.cached(a.conversation_id) is a
        with pytest.raises(TurnInFlight), store.answering(a.conversation_id):
            pass
    store.remember(Conversation(uuid.uuid4(), "tenant-a"))
    assert store.cached(a.conversation_id) is None and store.cached(c.conversation_id) is c


def test_a_conversation_is_rebuilt_from_the_log_for_its_tenant_only() -> None:
    log = InMemoryEventLog()
    writer = ConversationStore(log, utc_now, lambda: 10)
    conversation = Conversation(uuid.uuid4(), "tenant-a")

    async def case() -> Conversation:
        await writer.append(conversation, [started(conversation)], correlation_id=None)
        reader = ConversationStore(log, utc_now, lambda: 10)
        with pytest.raises(ConversationNotFound):
            await reader.get(principal("tenant-b"), conversation.conversation_id)
        return await reader.get(principal("tenant-a"), conversation.conversation_id)

    rebuilt = asyncio.run(case())
    assert (rebuilt.conversation_id, rebuilt.version, rebuilt.release_id) == (
        conversation.conversation_id,
        1,
        "r1",
    )


def test_a_stale_writer_is_refused_and_forgets_its_copy() -> None:
    """Two servers on one conversation: the one whose copy is behind gets a sequence conflict,
    never an interleaved conversation, and rebuilds from the log on next use."""
    log = InMemoryEventLog()
    first = ConversationStore(log, utc_now, lambda: 10)
    second = ConversationStore(log, utc_now, lambda: 10)
    owner = principal()
    conversation = Conversation(uuid.uuid4(), "tenant-a")

    async def case() -> int:
        await first.append(conversation, [started(conversation)], correlation_id=None)
        stale = await second.get(owner, conversation.conversation_id)
        fresh = await first.get(owner, conversation.conversation_id)
        await first.append(fresh, [received(fresh, "from-first")], correlation_id=None)
        with pytest.raises(SequenceConflict):
            await second.append(stale, [received(stale, "from-second")], correlation_id=None)
        assert second.cached(conversation.conversation_id) is None
        return (await second.get(owner, conversation.conversation_id)).version

    assert asyncio.run(case()) == 2
    assert [r.envelope.sequence for r in log.read()] == [1, 2]
