"""The one contract every ``EventLog`` adapter passes, unchanged.

Subclasses provide the ``log`` fixture, sealing tenants' words with the data keys they keep in
``self.keys`` (as every wired log does), and two hooks that write around the log, as a newer
writer or an attacker with storage access could: ``inject`` stores a raw envelope, and
``tamper`` changes the payload of a stored event.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest

from core.errors import EventIdConflict, InvalidEvent, SequenceConflict, TenantForgotten
from core.events import HarnessActionExecuted, HarnessStamp, NewEvent, TurnReceived
from core.events.chain import verify_chain
from core.events.privacy import PRIVATE, Forgotten
from core.log import EventLog, RecordedEvent
from tests.factories import raw_envelope, turn


def fingerprint(records: list[RecordedEvent]) -> list[tuple[str, int, str]]:
    return [(r.envelope.key, r.envelope.sequence, r.envelope.hash) for r in records]


class EventLogContract:
    keys: Any
    """The log's data keys (``DataKeys`` with ``forget``)."""

    def inject(self, log: EventLog, envelope: dict[str, Any]) -> None:
        raise NotImplementedError

    def tamper(self, log: EventLog, record: RecordedEvent, payload: dict[str, Any]) -> None:
        raise NotImplementedError

    def test_per_key_order(self, log: EventLog) -> None:
        keys = [f"conv-{uuid.uuid4()}" for _ in range(3)]
        for n in range(10):
            log.append([turn(k, n) for k in keys])
        everything = list(log.read())
        for k in keys:
            mine = [r for r in everything if r.envelope.key == k]
            assert [r.envelope.sequence for r in mine] == list(range(1, 11))
            assert [r.payload.client_msg_id for r in mine] == [f"msg-{n}" for n in range(10)]  # type: ignore[attr-defined]
            by_key = list(log.read(key=k))
            assert fingerprint(by_key) == fingerprint(mine)

    def test_append_returns_positions_and_chain(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        first, second = log.append([turn(key, 0), turn(key, 1)])
        assert first.envelope.sequence == 1 and first.envelope.prev_hash is None
        assert second.envelope.sequence == 2
        assert second.envelope.prev_hash == first.envelope.hash
        assert first.envelope.computed_hash() == first.envelope.hash
        assert fingerprint(list(log.read(key=key))) == fingerprint([first, second])
        assert [r.position for r in log.read(key=key)] == [first.position, second.position]

    def test_idempotent_reappend(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        event = turn(key, 0)
        [stored] = log.append([event])
        [again] = log.append([event])
        assert again.position == stored.position
        assert again.envelope == stored.envelope
        [dup_in_batch, other] = log.append([event, turn(key, 1)])
        assert dup_in_batch.position == stored.position
        assert other.envelope.sequence == 2
        assert len(list(log.read(key=key))) == 2

        changed = event.model_copy(
            update={"payload": event.payload.model_copy(update={"content": "something else"})}
        )
        with pytest.raises(EventIdConflict):
            log.append([changed])
        assert len(list(log.read(key=key))) == 2

    def test_expected_sequence_conflict_leaves_log_unchanged(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        log.append([turn(key, 0, sequence=1)])
        with pytest.raises(SequenceConflict) as caught:
            log.append([turn(key, 1, sequence=1)])
        assert caught.value.code == "sequence_conflict" and caught.value.retryable
        with pytest.raises(SequenceConflict):
            log.append([turn(key, 1, sequence=2), turn(key, 2, sequence=4)])
        assert [r.envelope.sequence for r in log.read(key=key)] == [1]

    def test_replay_from_start_is_identical_and_chain_verifies(self, log: EventLog) -> None:
        keys = [f"conv-{uuid.uuid4()}" for _ in range(4)]
        for n in range(25):
            log.append([turn(keys[n % 4], n)])
        first = list(log.read())
        second = list(log.read())
        assert len(first) == 25
        assert fingerprint(first) == fingerprint(second)
        assert [r.position for r in first] == [r.position for r in second]
        assert verify_chain(log.envelopes()) == []
        # A replay resumes from the positions a consumer saved after its tenth event.
        saved: dict[int, int] = {}
        for record in first[:10]:
            saved[record.position.partition] = record.position.offset + 1
        assert fingerprint(list(log.read(start=saved))) == fingerprint(first[10:])

    def test_concurrent_appenders_on_one_key(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        errors: list[BaseException] = []

        def writer(w: int) -> None:
            try:
                for n in range(20):
                    log.append([turn(key, w * 100 + n)])
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        records = list(log.read(key=key))
        assert [r.envelope.sequence for r in records] == list(range(1, 41))
        assert verify_chain(r.envelope for r in records) == []

    def test_concurrent_double_append_at_one_sequence(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def writer(n: int) -> None:
            barrier.wait()
            try:
                log.append([turn(key, n, sequence=1)])
                outcomes.append("ok")
            except SequenceConflict:
                outcomes.append("conflict")

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["conflict", "ok"]
        assert len(list(log.read(key=key))) == 1

    def test_unknown_type_and_version_go_to_dead_letters(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        [before] = log.append([turn(key, 0)])
        self.inject(
            log,
            raw_envelope(
                key=f"odd-{uuid.uuid4()}", type="FromTheFuture", schema_version=1, payload={"x": 1}
            ),
        )
        self.inject(
            log,
            raw_envelope(
                key=f"odd-{uuid.uuid4()}", type="TurnReceived", schema_version=99, payload={}
            ),
        )
        [after] = log.append([turn(key, 1)])
        seen = list(log.read())
        assert fingerprint(seen) == fingerprint([before, after])
        letters = log.dead_letters()
        assert sorted(d.code for d in letters) == ["unknown_event_type", "unknown_schema_version"]
        assert any("FromTheFuture" in d.reason for d in letters)
        assert all(d.raw for d in letters)
        list(log.read())  # reading again neither fails nor duplicates dead letters
        assert len(log.dead_letters()) == 2

    def test_old_schema_version_is_upcast_on_read(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        turn_id = uuid.uuid4()
        self.inject(
            log,
            raw_envelope(
                key=key,
                type="TurnReceived",
                schema_version=1,
                payload={
                    "conversation_id": str(uuid.uuid4()),
                    "turn_id": str(turn_id),
                    "text": "old form",
                },
            ),
        )
        log.append([turn(key, 1)])  # continues the chain of the v1 event
        first, second = list(log.read(key=key))
        assert isinstance(first.payload, TurnReceived)
        assert first.payload.content == "old form"
        assert first.payload.client_msg_id == str(turn_id)
        assert first.envelope.schema_version == 1  # the stored event is unchanged
        assert second.envelope.prev_hash == first.envelope.hash
        assert verify_chain(log.envelopes(key=key)) == []

    def test_tampered_event_is_caught(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        records = log.append([turn(key, n) for n in range(3)])
        assert verify_chain(log.envelopes(key=key)) == []
        forged = dict(records[1].envelope.payload, content="forged")
        self.tamper(log, records[1], forged)
        violations = verify_chain(log.envelopes(key=key))
        assert violations, "tampering went unnoticed"
        assert violations[0].kind == "hash_mismatch"
        assert violations[0].sequence == 2

    def test_payload_is_kept_exactly_as_hashed(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        action = HarnessActionExecuted(
            turn_id=uuid.uuid4(),
            action_id=uuid.uuid4(),
            name="calculator",
            args={"expression": "2**60"},
            result={"big": 2.0**60, "negative_zero": -0.0, "tiny": 1e-7, "text": "a\x00b é"},
            ok=True,
            harness=HarnessStamp(harness_version="h-test", hcp_version="hcp-1"),
        )
        event = NewEvent(payload=action, tenant_id="tenant-a", key=key)
        [stored] = log.append([event])
        [read] = list(log.read(key=key))
        assert read.envelope == stored.envelope
        assert read.envelope.computed_hash() == read.envelope.hash
        assert verify_chain(log.envelopes(key=key)) == []
        [again] = log.append([event])  # idempotent: the stored content digest still matches
        assert again.position == stored.position

    def test_unstorable_text_is_a_typed_error_and_stores_nothing(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        event = turn(key, 0)
        lone_surrogate = event.model_copy(
            update={"payload": event.payload.model_copy(update={"content": "bad \ud800"})}
        )
        with pytest.raises(InvalidEvent):
            log.append([turn(key, 1), lone_surrogate])
        assert list(log.read(key=key)) == []

    def test_types_filter(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        log.append([turn(key, n) for n in range(3)])
        assert len(list(log.read(types={"TurnReceived"}))) == 3
        assert list(log.read(types={"FeedbackGiven"})) == []

    def test_tail_follows_appends(self, log: EventLog) -> None:
        key = f"conv-{uuid.uuid4()}"
        log.append([turn(key, 0)])
        start = log.end_positions()
        appended: list[RecordedEvent] = []

        def writer() -> None:
            for n in range(1, 31):
                appended.extend(log.append([turn(key, n)]))

        thread = threading.Thread(target=writer)
        seen: list[RecordedEvent] = []
        idle = 0
        tail = log.tail(start=start, idle_timeout=0.5)
        thread.start()
        for item in tail:
            if item is None:
                idle += 1
            else:
                seen.append(item)
            if len(seen) == 30 or idle > 60:
                break
        thread.join()
        tail.close()
        assert fingerprint(seen) == fingerprint(appended)

    def test_ten_thousand_events_round_trip(self, log: EventLog) -> None:
        keys = [f"conv-{i}-{uuid.uuid4()}" for i in range(50)]
        written: list[RecordedEvent] = []
        for batch in range(20):
            written.extend(log.append([turn(keys[n % 50], batch * 500 + n) for n in range(500)]))
        assert len(written) == 10_000
        read = list(log.read())
        assert len(read) == 10_000
        assert sorted(fingerprint(read)) == sorted(fingerprint(written))
        assert {r.envelope.event_id: r.payload for r in read} == {
            r.envelope.event_id: r.payload for r in written
        }
        assert verify_chain(r.envelope for r in read) == []

    def test_tenants_words_are_stored_sealed(self, log: EventLog) -> None:
        tenant, key = f"t-{uuid.uuid4().hex[:8]}", f"conv-{uuid.uuid4()}"
        words = f"my secret recipe {uuid.uuid4().hex}"
        event = turn(key, 0, tenant=tenant).model_copy(
            update={"payload": turn(key, 0).payload.model_copy(update={"content": words})}
        )
        [stored] = log.append([event])
        [envelope] = log.envelopes(key=key)
        assert words not in json.dumps(envelope.to_json())
        assert PRIVATE in envelope.payload and "content" not in envelope.payload
        assert "client_msg_id" not in envelope.payload
        [read] = log.read(key=key)
        assert read.payload.content == words  # type: ignore[attr-defined]
        assert read.envelope == stored.envelope
        assert verify_chain(log.envelopes(key=key)) == []

    def test_a_forgotten_tenant_reads_as_forgotten_and_writes_nothing(self, log: EventLog) -> None:
        gone, kept = (f"t-{uuid.uuid4().hex[:8]}" for _ in range(2))
        keys = {t: f"conv-{uuid.uuid4()}" for t in (gone, kept)}
        for n in range(3):
            log.append([turn(keys[t], n, tenant=t) for t in (gone, kept)])
        assert self.keys.forget(gone) is True
        assert self.keys.forget(gone) is False
        mine = list(log.read(key=keys[gone]))
        assert [type(r.payload) for r in mine] == [Forgotten] * 3
        assert {r.payload.original_type for r in mine} == {"TurnReceived"}  # type: ignore[attr-defined]
        others = list(log.read(key=keys[kept]))
        assert [r.payload.client_msg_id for r in others] == ["msg-0", "msg-1", "msg-2"]  # type: ignore[attr-defined]
        assert verify_chain(log.envelopes(key=keys[gone])) == []
        with pytest.raises(TenantForgotten) as refused:
            log.append([turn(keys[gone], 3, tenant=gone)])
        assert refused.value.code == "tenant_forgotten"
        assert len(list(log.read(key=keys[gone]))) == 3
