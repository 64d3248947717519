"""vLLM's refusals as typed errors, by HTTP status and error type, never by message text."""

from __future__ import annotations

import json

from core.errors import EngineError, EngineOverloaded


class ReplicaLost(Exception):
    """The replica's connection or engine failed, or it lacks an adapter it was given: the
    request may go to another replica."""

    def __init__(self, reason: str, *, adapter_missing: bool = False) -> None:
        super().__init__(reason)
        self.adapter_missing = adapter_missing


def error_info(body: bytes) -> tuple[str, str]:
    """vLLM's error body ``{"error": {"type", "message"}}`` as (type, message)."""
    try:
        error = json.loads(body)["error"]
        return str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return "", body[:200].decode(errors="replace")


def refusal(status: int, kind: str, message: str, url: str) -> Exception:
    """A generation refusal by status and type: what the caller gets, or ``ReplicaLost`` when
    another replica should try."""
    if status == 429:
        return EngineOverloaded(f"vLLM replica {url} is overloaded: {message}")
    if status == 404 or kind == "NotFoundError":
        # An adapter this engine loaded, gone from the replica (a restart, or an unload behind
        # our back): the health check loads it again.
        return ReplicaLost(f"{status} {kind}: {message}", adapter_missing=True)
    if status >= 500:  # its engine failed
        return ReplicaLost(f"{status} {kind}: {message}")
    return EngineError(f"vLLM replica {url} refused the request ({status} {kind}): {message}")
