"""The master keys that wrap tenants' data keys (envelope encryption).

A master key file holds one key per line, ``ID BASE64`` (32 random bytes), ``#`` comments
allowed. The first key wraps new data keys; the others only unwrap keys wrapped before a
rotation, until ``macaron tenants rewrap`` has wrapped every data key with the first and the old
lines can go. ``MACARON_MASTER_KEY_FILE`` names the file; unset, it is ``$MACARON_HOME/
master.key``, made (mode 0600) the first time. A named file that is missing, or any file that
does not parse, refuses start-up with ``master_key_invalid``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from core.errors import MasterKeyInvalid
from core.events.privacy import KEY_BYTES, NONCE_BYTES
from core.settings import Settings

_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


@dataclass(frozen=True)
class MasterKeys:
    """The master keys of one file, the first being current."""

    current: str
    keys: dict[str, bytes] = field(repr=False)

    def wrap(self, secret: bytes, context: bytes) -> tuple[str, bytes]:
        """``secret`` wrapped with the current key: (its id, nonce and ciphertext)."""
        nonce = os.urandom(NONCE_BYTES)
        return self.current, nonce + AESGCM(self.keys[self.current]).encrypt(nonce, secret, context)

    def unwrap(self, master_id: str, wrapped: bytes, context: bytes) -> bytes:
        key = self.keys.get(master_id)
        if key is None:
            raise MasterKeyInvalid(
                f"a data key is wrapped with master key {master_id!r}, which the master key "
                "file does not hold"
            )
        try:
            return AESGCM(key).decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], context)
        except (InvalidTag, ValueError) as exc:
            raise MasterKeyInvalid(
                f"master key {master_id!r} does not unwrap the stored data keys: "
                "is this the master key file they were made with?"
            ) from exc


def master_key_path(settings: Settings) -> Path:
    return settings.master_key_file or settings.home / "master.key"


def load_master_keys(settings: Settings, wrapped_by: frozenset[str] = frozenset()) -> MasterKeys:
    """The master keys from settings' file. The default file is made when it does not exist,
    unless stored data keys are already wrapped (by the master keys ``wrapped_by``): a new key
    could never unwrap them."""
    path = master_key_path(settings)
    if settings.master_key_file is None and not path.exists():
        if wrapped_by:
            raise MasterKeyInvalid(
                f"no master key file at {path}, and the database holds data keys wrapped by "
                f"master key {', '.join(sorted(wrapped_by))}: set MACARON_MASTER_KEY_FILE to "
                "the file they were made with (or MACARON_HOME to the home that holds it)"
            )
        _make(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise MasterKeyInvalid(f"cannot read the master key file {path}: {exc}") from exc
    return parse_master_keys(text, str(path))


def parse_master_keys(text: str, source: str) -> MasterKeys:
    keys: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _ID.match(parts[0]):
            raise MasterKeyInvalid(f"{source}:{number}: expected 'ID BASE64'")
        try:
            secret = base64.b64decode(parts[1], validate=True)
        except binascii.Error as exc:
            raise MasterKeyInvalid(f"{source}:{number}: the key is not base64") from exc
        if len(secret) != KEY_BYTES:
            raise MasterKeyInvalid(f"{source}:{number}: a key is {KEY_BYTES} bytes")
        if parts[0] in keys:
            raise MasterKeyInvalid(f"{source}:{number}: key id {parts[0]!r} is repeated")
        keys[parts[0]] = secret
    if not keys:
        raise MasterKeyInvalid(f"{source} holds no master key")
    return MasterKeys(next(iter(keys)), keys)


def new_master_key_line(key_id: str) -> str:
    if not _ID.match(key_id):
        raise MasterKeyInvalid(f"a master key id is 1-40 of A-Z a-z 0-9 _ -, not {key_id!r}")
    return f"{key_id} {base64.b64encode(os.urandom(KEY_BYTES)).decode()}\n"


def _make(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return
    with os.fdopen(fd, "w") as out:
        out.write("# macaron master key: wraps every tenant's data key; back it up\n")
        out.write(new_master_key_line("m1"))
