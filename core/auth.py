"""API keys: what a key grants, and how one is made and recognised.

A key is ``mk_`` plus 32 random bytes (URL-safe base64). It is shown once when made; only its
sha256 is stored. A fast hash is right here: the key is random and long, so there is nothing
for a slow password hash to protect against.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from core.errors import Forbidden, InvalidApiKey

Scope = Literal["chat", "admin", "metrics"]
KEY_PREFIX = "mk_"
_KEY = re.compile(r"mk_[A-Za-z0-9_-]{43}")
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$"


class Principal(BaseModel):
    """Who is calling: the tenant that owns the key, the key, and what it may do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant_id: str = Field(pattern=TENANT_PATTERN)
    key_id: UUID
    scopes: frozenset[Scope]

    def allows(self, scope: Scope) -> bool:
        return scope in self.scopes

    def require(self, scope: Scope) -> Principal:
        """This principal, if its key grants ``scope``; ``Forbidden`` otherwise."""
        if not self.allows(scope):
            raise Forbidden(f"this key does not grant the {scope} scope")
        return self


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """The stored form of a key; refuses anything that is not shaped like one of ours."""
    if not _KEY.fullmatch(key):
        raise InvalidApiKey("the API key is missing or malformed")
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header; empty for none or another scheme
    (which then fails authentication like any malformed key)."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""
