"""Canonical JSON: the one byte form that hashes are computed over.

Keys sorted, no insignificant whitespace, UTF-8, no NaN or infinity. The same value always gives
the same bytes, so a hash computed by a writer can be recomputed by any reader.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` (JSON types only) to canonical bytes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
