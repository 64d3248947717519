"""Tenants' words in the log, sealed with the tenant's own data key, so that destroying the key
forgets them (crypto-shredding) while each event keeps its place, its size and its hash.

A payload class names its ``private_fields``: those that hold what a tenant said or was told.
Sealing moves them, as one canonical JSON object, into ``$private``: AES-256-GCM under the
tenant's data key, with the tenant, the event id, the key and the sequence as associated data
(a ciphertext moved to another event does not open). The chain hashes the stored form, so
``log verify`` needs no key before or after forgetting. Opening puts the fields back; every
event of a tenant whose key is destroyed reads as ``Forgotten``.

An event's content digest (what makes a repeated append idempotent) is an HMAC under the data
key over the sealed fields and the others, so the digest of a forgotten event says nothing.

Derived state that must hold a tenant's words (the experience builder's join state) stores them
as ``Cells``: each value sealed alone under the same key, so no readable copy of them reaches a
table, its dead tuples or the write-ahead log, and destroying the key forgets them there too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol
from uuid import UUID

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import JsonValue

from core.canonical import canonical_json
from core.errors import InvalidEvent
from core.events.envelope import Envelope, EventPayload

PRIVATE = "$private"
"""The stored payload's field for the sealed part; no payload field may start with ``$``."""
KEY_BYTES = 32
NONCE_BYTES = 12
_DIGEST_LABEL = b"macaron content digest"
_NONCE_LABEL = b"macaron cell nonce"
_KEY_ID_BYTES = 16


@dataclass(frozen=True)
class DataKey:
    """One tenant's data key: AES-256, known by its id (stored beside each ciphertext)."""

    key_id: UUID
    secret: bytes = field(repr=False)

    @staticmethod
    def new(key_id: UUID) -> DataKey:
        return DataKey(key_id, os.urandom(KEY_BYTES))

    @cached_property
    def aead(self) -> AESGCM:
        return AESGCM(self.secret)

    @cached_property
    def _digest_key(self) -> bytes:
        return hmac.digest(self.secret, _DIGEST_LABEL, hashlib.sha256)

    def digest(self, plaintext: bytes) -> str:
        """HMAC-SHA256 of ``plaintext`` under a subkey of this key."""
        return hmac.digest(self._digest_key, plaintext, hashlib.sha256).hex()

    @cached_property
    def _nonce_key(self) -> bytes:
        return hmac.digest(self.secret, _NONCE_LABEL, hashlib.sha256)

    def synthetic_nonce(self, aad: bytes, plaintext: bytes) -> bytes:
        """A nonce derived from what it seals (a keyed digest of both): the same value in the
        same place seals to the same bytes, and two different ones never share a nonce."""
        digest = hmac.digest(self._nonce_key, aad + b"\x1e" + plaintext, hashlib.sha256)
        return digest[:NONCE_BYTES]


class DataKeys(Protocol):
    """Where tenants' data keys live, wrapped by a master key (``infra.postgres.data_keys``)."""

    def writing_key(self, tenant_id: str) -> DataKey:
        """The tenant's key, made on first use; raises ``TenantForgotten``."""
        ...

    def reading_key(self, tenant_id: str, key_id: UUID) -> DataKey | None:
        """The key a stored event was sealed with, or ``None`` once it is destroyed; a key
        this store never held is ``InvalidEvent`` (a log read against another database)."""
        ...

    def is_forgotten(self, tenant_id: str) -> bool: ...


class Forgotten(EventPayload):
    """What an event of a forgotten tenant reads as: its type, and nothing of what it held.
    Never stored; processors take nothing from it (the training trigger notes whose record it
    was, to leave that tenant out of its ranges) and go on."""

    event_type = "Forgotten"
    original_type: str


def _aad(at: Envelope) -> bytes:
    """The associated data: the tenant, the event id, the key and the sequence."""
    return "\x1f".join((at.tenant_id, str(at.event_id), at.key, str(at.sequence))).encode()


@dataclass(frozen=True)
class SealedPayload:
    """A payload as stored: its private fields sealed, as JSON values and as canonical bytes;
    and its content digest, keyed with the data key."""

    stored: dict[str, JsonValue]
    stored_json: bytes
    digest: str


@dataclass(frozen=True)
class Cipher:
    """Seals and opens the private part of payloads with the tenants' data keys."""

    keys: DataKeys

    def seal(
        self,
        payload: dict[str, JsonValue],
        private: Collection[str],
        at: Envelope,
    ) -> SealedPayload | None:
        """The stored form of ``payload`` for the event ``at`` (its identity and place);
        ``None`` when it holds nothing private (stored as it is). Raises ``TenantForgotten``
        for a forgotten tenant, whatever the event holds."""
        key = self.keys.writing_key(at.tenant_id)
        hidden = {name: payload[name] for name in private if name in payload}
        if not hidden:
            return None
        hidden_json = canonical_json(hidden)
        nonce = os.urandom(NONCE_BYTES)
        sealed = key.aead.encrypt(nonce, hidden_json, _aad(at))
        public: dict[str, JsonValue] = {k: v for k, v in payload.items() if k not in hidden}
        part: dict[str, JsonValue] = {
            "key_id": str(key.key_id),
            "nonce": base64.b64encode(nonce).decode(),
            "sealed": base64.b64encode(sealed).decode(),
        }
        public_json = canonical_json(public)
        # "$private" sorts before every field name, so the canonical form is spliced, not redone.
        rest = b"}" if public_json == b"{}" else b"," + public_json[1:]
        stored_json = b'{"' + PRIVATE.encode() + b'":' + canonical_json(part) + rest
        digest = key.digest(hidden_json + b"\x1e" + public_json)
        return SealedPayload({PRIVATE: part, **public}, stored_json, digest)

    def open(self, envelope: Envelope) -> dict[str, JsonValue] | None:
        """The payload as written, or ``None`` when its tenant's key is destroyed. A sealed part
        that does not open (changed, moved, malformed, or its key unknown) is
        ``InvalidEvent``."""
        if PRIVATE not in envelope.payload:
            return dict(envelope.payload)
        opened = self._opened(envelope)
        return None if opened is None else {**opened[2], **_json_object(opened[1])}

    def digest(self, envelope: Envelope) -> str | None:
        """The keyed digest of a stored sealed event (``None``: not sealed, or forgotten)."""
        if PRIVATE not in envelope.payload:
            return None
        opened = self._opened(envelope)
        if opened is None:
            return None
        key, hidden_json, public = opened
        return key.digest(hidden_json + b"\x1e" + canonical_json(public))

    def _opened(self, envelope: Envelope) -> tuple[DataKey, bytes, dict[str, JsonValue]] | None:
        """A sealed event's key, its private fields as sealed (canonical JSON) and its other
        fields; ``None`` once the key is destroyed."""
        stored = dict(envelope.payload)
        part = stored.pop(PRIVATE)
        try:
            if not isinstance(part, dict):
                raise ValueError("not an object")
            key_id = UUID(str(part["key_id"]))
            nonce = base64.b64decode(str(part["nonce"]), validate=True)
            sealed = base64.b64decode(str(part["sealed"]), validate=True)
        except (KeyError, ValueError) as exc:
            raise InvalidEvent(f"{envelope.type}: malformed {PRIVATE} part: {exc}") from exc
        key = self.keys.reading_key(envelope.tenant_id, key_id)
        if key is None:
            return None
        try:
            hidden = key.aead.decrypt(nonce, sealed, _aad(envelope))
        except (InvalidTag, ValueError) as exc:
            raise InvalidEvent(
                f"{envelope.type}: the {PRIVATE} part does not open for this event"
            ) from exc
        return key, hidden, stored


def _json_object(data: bytes) -> dict[str, JsonValue]:
    value = json.loads(data)
    if not isinstance(value, dict):
        raise InvalidEvent(f"the {PRIVATE} part is not a JSON object")
    return value


@dataclass(frozen=True)
class Cells:
    """Tenants' words in derived tables, each value sealed alone under its tenant's data key
    (AES-256-GCM, the tenant and the cell's place as associated data: a value moved to another
    row or tenant does not open). Sealing is deterministic (``DataKey.synthetic_nonce``), so a
    replay's tables hash as the live ones. Stored as base64 text: the key id, the nonce, the
    ciphertext."""

    keys: DataKeys

    def seal(self, tenant_id: str, place: str, value: JsonValue) -> str:
        """``value`` sealed for the cell ``place`` (a table, a column and a row's id); raises
        ``TenantForgotten`` for a forgotten tenant."""
        key = self.keys.writing_key(tenant_id)
        plaintext, aad = canonical_json(value), _cell_aad(tenant_id, place)
        nonce = key.synthetic_nonce(aad, plaintext)
        sealed = key.key_id.bytes + nonce + key.aead.encrypt(nonce, plaintext, aad)
        return base64.b64encode(sealed).decode()

    def open(self, tenant_id: str, place: str, stored: str) -> JsonValue | None:
        """The value sealed in ``stored``, or ``None`` once the tenant's key is destroyed; a
        cell that does not open here (changed, moved or malformed) is ``InvalidEvent``: the
        derived state no longer matches the log it was derived from."""
        try:
            raw = base64.b64decode(stored, validate=True)
            key_id = UUID(bytes=raw[:_KEY_ID_BYTES])
        except ValueError as exc:
            raise InvalidEvent(f"a sealed cell of {place} is malformed: {exc}") from exc
        key = self.keys.reading_key(tenant_id, key_id)
        if key is None:
            return None
        nonce, sealed = raw[_KEY_ID_BYTES:][:NONCE_BYTES], raw[_KEY_ID_BYTES + NONCE_BYTES :]
        try:
            plaintext = key.aead.decrypt(nonce, sealed, _cell_aad(tenant_id, place))
        except (InvalidTag, ValueError) as exc:
            raise InvalidEvent(f"a sealed cell of {place} does not open for its row") from exc
        value: JsonValue = json.loads(plaintext)
        return value


def _cell_aad(tenant_id: str, place: str) -> bytes:
    return f"cell\x1f{tenant_id}\x1f{place}".encode()
