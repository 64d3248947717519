"""Tenants' words sealed with their data keys: what is stored, what opens, what never opens,
and the master key file that wraps the keys."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import JsonValue

from core.canonical import canonical_json, sha256_hex
from core.errors import InvalidEvent, MasterKeyInvalid, TenantForgotten
from core.events import CATALOGUE, Envelope, FeedbackGiven, NewEvent, chain_hash
from core.events.privacy import PRIVATE, Cells, Cipher, Forgotten
from core.ids import uuid7
from core.log import DeadLetter, LogPosition, RecordedEvent
from core.mapper import Mapper
from core.settings import Settings
from infra.master_key import load_master_keys, new_master_key_line, parse_master_keys
from infra.memory import InMemoryDataKeys
from tests.factories import turn

AT = LogPosition(0, 1)


def sealed_pair() -> tuple[Cipher, InMemoryDataKeys, Envelope, Envelope]:
    keys = InMemoryDataKeys()
    cipher = Cipher(keys)
    first = Mapper(cipher).seal(turn("conv-1", 0), 1, None).envelope
    second = Mapper(cipher).seal(turn("conv-1", 1), 2, first.hash).envelope
    return cipher, keys, first, second


def rehashed(envelope: Envelope, payload: dict[str, object]) -> Envelope:
    """The envelope with another payload and a hash that matches it (as a forger would)."""
    changed = replace(envelope, payload=payload)  # type: ignore[arg-type]
    digest = sha256_hex(canonical_json(changed.payload))
    return replace(changed, hash=chain_hash(changed.header(), digest))


def test_private_fields_are_stored_sealed_and_open_with_the_key() -> None:
    cipher, _, first, _ = sealed_pair()
    stored = json.dumps(first.to_json())
    assert "msg-0" not in stored and "content" not in first.payload
    assert set(first.payload) >= {PRIVATE, "turn_id", "conversation_id"}
    assert first.computed_hash() == first.hash
    record = Mapper(cipher).decode(AT, first)
    assert isinstance(record, RecordedEvent)
    assert record.payload.client_msg_id == "msg-0"  # type: ignore[attr-defined]


def test_a_sealed_part_moved_or_changed_does_not_open() -> None:
    cipher, _, first, second = sealed_pair()
    moved = rehashed(second, {**second.payload, PRIVATE: first.payload[PRIVATE]})
    letter = Mapper(cipher).decode(AT, moved)
    assert isinstance(letter, DeadLetter) and letter.code == "invalid_event"
    assert "does not open" in letter.reason
    part = dict(first.payload[PRIVATE])  # type: ignore[arg-type]
    part["sealed"] = "AAAA" + str(part["sealed"])[4:]
    changed = Mapper(cipher).decode(AT, rehashed(first, {**first.payload, PRIVATE: part}))
    assert isinstance(changed, DeadLetter) and changed.code == "invalid_event"
    garbled = rehashed(first, {**first.payload, PRIVATE: "not an object"})
    assert isinstance(Mapper(cipher).decode(AT, garbled), DeadLetter)


def test_a_sealed_payload_without_keys_is_a_dead_letter_and_plaintext_reads_as_it_is() -> None:
    cipher, _, first, _ = sealed_pair()
    letter = Mapper().decode(AT, first)
    assert isinstance(letter, DeadLetter) and "no data keys" in letter.reason
    plain = Mapper().seal(turn("conv-2", 0), 1, None).envelope  # written before tenants had keys
    record = Mapper(cipher).decode(AT, plain)
    assert isinstance(record, RecordedEvent) and record.payload.client_msg_id == "msg-0"  # type: ignore[attr-defined]


def test_a_forgotten_tenants_events_read_as_markers() -> None:
    cipher, keys, first, _ = sealed_pair()
    plain = (
        Mapper().seal(turn("conv-2", 0), 1, None).envelope
    )  # its own events from before keys, too
    assert keys.forget("tenant-a") is True
    for envelope in (first, plain):
        record = Mapper(cipher).decode(AT, envelope)
        assert isinstance(record, RecordedEvent)
        assert record.payload == Forgotten(original_type="TurnReceived")


def test_the_content_digest_is_keyed_and_the_same_for_a_repeat() -> None:
    keys = InMemoryDataKeys()
    cipher = Cipher(keys)
    event = turn("conv-1", 0)
    once, again = Mapper(cipher).seal(event, 1, None), Mapper(cipher).seal(event, 7, "0" * 64)
    assert once.envelope.payload[PRIVATE] != again.envelope.payload[PRIVATE]  # fresh nonces
    assert once.content_digest == again.content_digest
    assert Mapper(cipher).content_digest(once.envelope) == once.content_digest
    assert (
        once.content_digest != Mapper().seal(event, 1, None).content_digest
    )  # not the plaintext's
    other = NewEvent(
        payload=event.payload.model_copy(update={"content": "else"}),
        tenant_id="tenant-a",
        key="conv-1",
        event_id=event.event_id,
    )
    assert Mapper(cipher).seal(other, 1, None).content_digest != once.content_digest


def test_every_private_field_is_a_field_of_its_event() -> None:
    for cls in CATALOGUE.values():
        assert set(cls.private_fields) <= set(cls.model_fields), cls.event_type
        assert not any(name.startswith("$") for name in cls.model_fields)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "holds no master key"),
        ("# only a comment\n", "holds no master key"),
        ("m1\n", "expected 'ID BASE64'"),
        ("m1 not-base64!\n", "not base64"),
        ("m1 AAAA\n", "32 bytes"),
        (new_master_key_line("m1") + new_master_key_line("m1"), "repeated"),
    ],
    ids=["empty", "comment only", "no key", "not base64", "short key", "repeated id"],
)
def test_a_bad_master_key_file_is_refused(text: str, problem: str) -> None:
    with pytest.raises(MasterKeyInvalid, match=problem) as refused:
        parse_master_keys(text, "keys")
    assert refused.value.code == "master_key_invalid"


def test_the_default_master_key_is_made_private_and_a_named_one_must_exist(tmp_path: Path) -> None:
    made = load_master_keys(Settings(home=tmp_path))
    path = tmp_path / "master.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_master_keys(Settings(home=tmp_path)) == made  # made once
    with pytest.raises(MasterKeyInvalid, match="cannot read"):
        load_master_keys(Settings(home=tmp_path, master_key_file=tmp_path / "missing.key"))


def test_a_key_wrapped_by_one_master_does_not_unwrap_with_another() -> None:
    one = parse_master_keys(new_master_key_line("a"), "one")
    other = parse_master_keys(new_master_key_line("a"), "other")
    master_id, wrapped = one.wrap(b"k" * 32, b"tenant")
    assert one.unwrap(master_id, wrapped, b"tenant") == b"k" * 32
    with pytest.raises(MasterKeyInvalid, match="does not unwrap"):
        other.unwrap(master_id, wrapped, b"tenant")
    with pytest.raises(MasterKeyInvalid, match="does not unwrap"):
        one.unwrap(master_id, wrapped, b"another tenant")
    with pytest.raises(MasterKeyInvalid, match="does not hold"):
        one.unwrap("b", wrapped, b"tenant")


def test_an_event_read_against_other_keys_is_a_dead_letter_not_forgotten() -> None:
    _, _, first, _ = sealed_pair()
    elsewhere = Mapper(Cipher(InMemoryDataKeys())).decode(AT, first)
    assert isinstance(elsewhere, DeadLetter) and elsewhere.code == "invalid_event"
    assert "no data key" in elsewhere.reason


def test_the_stored_bytes_are_the_canonical_form_of_the_stored_payload() -> None:
    """Sealing splices the stored JSON from its parts; it must be exactly what a reader that
    serialises the stored payload gets, or the hash would not verify."""
    cipher = Cipher(InMemoryDataKeys())
    events = [
        turn("conv-1", 0),
        turn("conv-1", 1).model_copy(
            update={"payload": turn("k", 1).payload.model_copy(update={"content": 'é ✓ "q"'})}
        ),
        NewEvent(payload=FeedbackGiven(turn_id=uuid7(), kind="up"), tenant_id="t", key="k"),
    ]
    for n, event in enumerate(events, start=1):
        sealed = Mapper(cipher).seal(event, n, None)
        assert sealed.payload_json.encode() == canonical_json(sealed.envelope.payload)
        assert sealed.envelope.computed_hash() == sealed.envelope.hash
        assert Mapper(cipher).content_digest(sealed.envelope) == sealed.content_digest
        record = Mapper(cipher).decode(AT, sealed.envelope)
        assert isinstance(record, RecordedEvent) and record.payload == event.payload


def test_a_sealed_cell_opens_in_its_place_only_and_not_once_forgotten() -> None:
    keys = InMemoryDataKeys()
    cells = Cells(keys)
    value: JsonValue = {"role": "user", "content": "my secret plan"}
    stored = cells.seal("acme", "experience_turns.content:t1", value)
    assert (
        "secret" not in stored
        and cells.open("acme", "experience_turns.content:t1", stored) == value
    )
    assert cells.seal("acme", "experience_turns.content:t1", value) == stored  # a replay's cell
    assert cells.seal("acme", "experience_turns.content:t2", value) != stored
    for tenant, place in [("acme", "experience_turns.content:t2"), ("acme", "other:t1")]:
        with pytest.raises(InvalidEvent, match="does not open"):
            cells.open(tenant, place, stored)
    cells.seal("globex", "experience_turns.content:t1", value)  # globex has a key of its own
    with pytest.raises(InvalidEvent):
        cells.open("globex", "experience_turns.content:t1", stored)
    for malformed in ["not base64!", "AAAA"]:
        with pytest.raises(InvalidEvent, match="malformed"):
            cells.open("acme", "experience_turns.content:t1", malformed)
    keys.forget("acme")
    assert cells.open("acme", "experience_turns.content:t1", stored) is None
    with pytest.raises(TenantForgotten):
        cells.seal("acme", "experience_turns.content:t1", value)
