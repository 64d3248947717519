"""Pure domain: ids, canonical JSON, sealing, the hash chain, upcasting, decoding."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from core.canonical import canonical_json
from core.errors import InvalidEvent, UnknownEventType, UnknownSchemaVersion
from core.events import (
    CATALOGUE,
    Envelope,
    FeedbackGiven,
    NewEvent,
    RolloutSampled,
    TurnReceived,
    decode_payload,
)
from core.events.chain import verify_chain
from core.events.upcasters import UpcasterRegistry
from core.ids import uuid7, uuid7_time_ms
from core.log import LogPosition, RecordedEvent, parse_envelope
from core.mapper import Mapper
from tests.factories import raw_envelope, turn


def test_uuid7_layout_and_order() -> None:
    ids = [uuid7() for _ in range(5000)]
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    assert ids == sorted(ids), "ids made in one process must sort in creation order"
    assert len(set(ids)) == len(ids)
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    assert abs(uuid7_time_ms(ids[-1]) - now_ms) < 5000


def test_canonical_json_is_stable() -> None:
    assert canonical_json({"b": 1, "a": [1.5, "é", None]}) == '{"a":[1.5,"é",null],"b":1}'.encode()
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_catalogue_names_every_event_of_the_data_flow() -> None:
    assert set(CATALOGUE) == {
        "ConversationStarted",
        "TurnReceived",
        "RouterDecided",
        "HarnessActionExecuted",
        "GenUIRendered",
        "ModelResponded",
        "TurnCompleted",
        "FeedbackGiven",
        "RoutingCorrected",
        "RoutingLabelled",
        "SpecialistAdded",
        "TenantTrainingSet",
        "TenantForgotten",
        "ExperienceRecorded",
        "RolloutSampled",
        "RolloutScored",
        "TasksWritten",
        "TrainingRequested",
        "RouterTrainingRequested",
        "UnlearningRequested",
        "RouterEvaluated",
        "CandidateTrained",
        "HarnessProposed",
        "ContractEvaluated",
        "ReleasePromoted",
        "PromotionRejected",
        "ReleaseRolledBack",
    }
    for name, cls in CATALOGUE.items():
        assert cls.event_type == name
        assert cls.model_config.get("frozen") is True


def test_seal_links_and_hashes() -> None:
    first = Mapper().seal(turn("conv-1", 0), 1, None)
    second = Mapper().seal(turn("conv-1", 1), 2, first.envelope.hash)
    assert first.envelope.computed_hash() == first.envelope.hash
    assert second.envelope.prev_hash == first.envelope.hash
    assert verify_chain([first.envelope, second.envelope]) == []
    # The JSON written to a broker parses back to the same envelope.
    assert parse_envelope(second.envelope_json()) == second.envelope
    assert second.content_digest == Mapper().content_digest(second.envelope)
    with pytest.raises(ValidationError):
        Envelope.validate({**first.envelope.to_json(), "hash": "not-a-hash"})


def test_chain_catches_change_gap_and_relink() -> None:
    chain: list[Envelope] = []
    prev = None
    for n in range(4):
        chain.append(Mapper().seal(turn("k", n), n + 1, prev).envelope)
        prev = chain[-1].hash
    changed = replace(chain[1], payload={**chain[1].payload, "content": "x"})
    kinds = [v.kind for v in verify_chain([chain[0], changed, chain[2], chain[3]])]
    assert kinds == ["hash_mismatch"]
    assert [v.kind for v in verify_chain([chain[0], chain[2], chain[3]])] == ["sequence_gap"]
    relinked = replace(chain[2], prev_hash=chain[0].hash)
    assert "prev_hash_mismatch" in [v.kind for v in verify_chain([chain[0], chain[1], relinked])]
    # An exact repeat (at-least-once delivery) is not a violation.
    assert verify_chain([chain[0], chain[1], chain[1], chain[2]]) == []
    # A forged copy under the same id is.
    assert verify_chain([chain[0], chain[1], changed]) != []


def test_new_event_validation() -> None:
    with pytest.raises(ValidationError):
        turn("bad key with spaces")
    with pytest.raises(ValidationError):
        NewEvent(
            payload=FeedbackGiven(turn_id=uuid.uuid4(), kind="up"),
            tenant_id="t",
            key="k",
            occurred_at=datetime(2026, 1, 1),
        )  # naive timestamp
    with pytest.raises(ValidationError):
        FeedbackGiven(turn_id=uuid.uuid4(), kind="sideways")  # type: ignore[arg-type]
    local = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    event = NewEvent(
        payload=FeedbackGiven(turn_id=uuid.uuid4(), kind="up"),
        tenant_id="t",
        key="k",
        occurred_at=local,
    )
    assert event.occurred_at == local and event.occurred_at.tzinfo == UTC


def test_upcaster_registry() -> None:
    registry = UpcasterRegistry()

    @registry.register("Thing", 1)
    def v1(p: dict[str, object]) -> dict[str, object]:
        return {**p, "b": 2}

    @registry.register("Thing", 2)
    def v2(p: dict[str, object]) -> dict[str, object]:
        return {**p, "c": 3}

    assert registry.upcast("Thing", 1, {"a": 1}, 3) == {"a": 1, "b": 2, "c": 3}
    assert registry.upcast("Thing", 3, {"a": 1}, 3) == {"a": 1}
    with pytest.raises(UnknownSchemaVersion):
        registry.upcast("Thing", 4, {}, 3)
    with pytest.raises(UnknownSchemaVersion):
        registry.upcast("Other", 1, {}, 2)
    with pytest.raises(ValueError):
        registry.register("Thing", 1)(v1)


def test_turn_received_v1_is_upcast_to_v5() -> None:
    turn_id = uuid.uuid4()
    stored = Envelope.validate(
        raw_envelope(
            key="k",
            type="TurnReceived",
            schema_version=1,
            payload={"conversation_id": str(uuid.uuid4()), "turn_id": str(turn_id), "text": "hi"},
        )
    )
    payload = decode_payload(stored)
    assert isinstance(payload, TurnReceived)
    assert (payload.content, payload.client_msg_id, payload.specialist_hint) == (
        "hi",
        str(turn_id),
        None,
    )
    assert (payload.input_kind, payload.release_id, payload.harness) == ("text", None, None)
    assert payload.regenerates is None and payload.decoding is None
    assert stored.payload["text"] == "hi"  # decoding never changes the stored envelope


def test_a_rollout_sample_of_v1_reads_as_never_swept() -> None:
    payload = {
        "rollout_id": str(uuid.uuid4()),
        "group_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "sample": 0,
        "group_size": 1,
        "environment": "bank-v2/bank-agent-041",
        "specialist": "agent",
        "release_id": "release-0",
        "adapter_version": None,
        "harness": {"harness_version": "harness@0", "hcp_version": "hcp-1"},
        "messages": [{"role": "user", "content": "Remember that my shoe size is 43."}],
        "hint": None,
        "seed": 7,
        "temperature": 0.8,
        "steps": [{"output": "{}"}],
    }
    stored = Envelope.validate(
        raw_envelope(key="k", type="RolloutSampled", schema_version=1, payload=payload)
    )
    sample = decode_payload(stored)
    assert isinstance(sample, RolloutSampled) and RolloutSampled.schema_version == 2
    assert (sample.first_call, sample.hint, sample.seed) == (None, None, 7)
    assert "first_call" not in stored.payload


def test_decode_errors_are_typed() -> None:
    unknown = Envelope.validate(raw_envelope(key="k", type="Nope", schema_version=1, payload={}))
    with pytest.raises(UnknownEventType):
        decode_payload(unknown)
    invalid = Envelope.validate(
        raw_envelope(key="k", type="FeedbackGiven", schema_version=1, payload={"kind": "up"})
    )
    with pytest.raises(InvalidEvent):
        decode_payload(invalid)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"{not json", "invalid_event"),
        (b"\xff\xfe", "invalid_event"),
        (b"[]", "invalid_event"),
        (b'{"event_id": "x"}', "invalid_event"),
    ],
)
def test_decode_stored_sets_malformed_records_aside(raw: bytes, code: str) -> None:
    result = Mapper().decode_stored(LogPosition(0, 7), raw)
    assert not isinstance(result, RecordedEvent)
    assert result.code == code and result.position == LogPosition(0, 7)


def test_undecodable_records_become_dead_letters_not_crashes() -> None:
    tombstone = Mapper().decode_stored(LogPosition(2, 5), None)
    assert not isinstance(tombstone, RecordedEvent) and tombstone.code == "invalid_event"
    # A v1 TurnReceived without its "text" field: the upcaster cannot lift it.
    broken_v1 = raw_envelope(
        key="k",
        type="TurnReceived",
        schema_version=1,
        payload={"conversation_id": str(uuid.uuid4()), "turn_id": str(uuid.uuid4())},
    )
    letter = Mapper().decode_stored(LogPosition(0, 9), broken_v1)
    assert not isinstance(letter, RecordedEvent)
    assert letter.code == "invalid_event" and "TurnReceived v1" in letter.reason


def test_lone_surrogates_are_refused_when_sealing() -> None:
    event = turn("k", 0)
    bad = event.model_copy(
        update={"payload": event.payload.model_copy(update={"content": "x \ud800"})}
    )
    with pytest.raises(InvalidEvent):
        Mapper().seal(bad, 1, None)
