"""Typed errors with stable codes.

Every error a user or an operator can hit is a ``MacaronError`` subclass with a stable ``code``.
Boundaries map errors to responses by type (walking the class hierarchy), never by message text.
"""

from __future__ import annotations


class MacaronError(Exception):
    """Base class: ``code`` is stable and machine-readable; the message is for people."""

    code = "internal"
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidEvent(MacaronError):
    """An event or envelope failed validation (bad field, wrong type, bad payload)."""

    code = "invalid_event"


class UnknownEventType(InvalidEvent):
    """The log holds an event type this code does not know."""

    code = "unknown_event_type"


class UnknownSchemaVersion(InvalidEvent):
    """The log holds a schema version newer than this code, or one without an upcaster."""

    code = "unknown_schema_version"


class SequenceConflict(MacaronError):
    """An append expected a key to be at one sequence, but another writer got there first."""

    code = "sequence_conflict"
    retryable = True


class EventIdConflict(MacaronError):
    """An event id is already stored with different content (ids are idempotency keys)."""

    code = "event_id_conflict"


class ChainBroken(MacaronError):
    """The per-key hash chain does not verify: a stored event was changed or removed."""

    code = "chain_broken"


class LogUnavailable(MacaronError):
    """The event log's storage (PostgreSQL or the broker) cannot be reached right now."""

    code = "unavailable"
    retryable = True


class ConfigError(MacaronError):
    """Settings or command-line arguments are invalid."""

    code = "config_invalid"


class StackError(MacaronError):
    """The embedded local stack could not start, stop, or be inspected."""

    code = "stack_error"
