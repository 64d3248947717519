"""Typed errors with stable codes.

Every error a user or an operator can hit is a ``MacaronError`` subclass with a stable ``code``.
Boundaries map errors to responses by type (walking the class hierarchy), never by message text.
"""

from __future__ import annotations

from pydantic import ValidationError


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


class ModelUnavailable(MacaronError):
    """A base model cannot be fetched, converted or loaded (offline, corrupt, unknown)."""

    code = "model_unavailable"


class DtypeUnsupported(ConfigError):
    """A dtype (served, or a training run's precision) this machine cannot run natively."""

    code = "dtype_unsupported"


class ModelUnsupported(ModelUnavailable):
    """A base model of an architecture the local engine does not serve."""

    code = "model_unsupported"


class ModelInvalid(ModelUnavailable):
    """A base model folder that is incomplete or inconsistent: missing tensors, a shape that
    does not match its config, or a tokenizer without a chat template."""

    code = "model_invalid"


class EngineOverloaded(MacaronError):
    """The engine's queue is full: try again shortly."""

    code = "overloaded"
    retryable = True


class AdapterNotFound(MacaronError):
    """A request or command names an adapter that is not loaded."""

    code = "adapter_not_found"


class AdapterInvalid(MacaronError):
    """An adapter's files are missing, malformed, or do not fit the base model."""

    code = "adapter_invalid"


class AdapterErased(MacaronError):
    """A release names an adapter version whose weights were erased because it learned from a
    forgotten tenant (``server.erasure.erase_replaced``): it can be neither promoted nor
    rolled back to."""

    code = "adapter_erased"


class RouterErased(MacaronError):
    """A release names a router version whose weights were erased because it was fitted on a
    forgotten tenant's routing labels (``server.erasure.erase_replaced``): it can be neither
    loaded, promoted nor rolled back to."""

    code = "router_erased"


class AdapterRankTooLarge(AdapterInvalid):
    """An adapter's rank is above the engine's maximum."""

    code = "adapter_rank_too_large"


class AdapterCapacityExceeded(MacaronError):
    """No room for another adapter: every loaded adapter is in use."""

    code = "adapter_capacity"
    retryable = True


class EmbedderUnavailable(MacaronError):
    """The router's sentence-embedding model cannot be found or loaded."""

    code = "embedder_unavailable"


class EngineUnavailable(MacaronError):
    """The engine is shut down (or shutting down) and takes no more requests."""

    code = "unavailable"
    retryable = True


class EngineWithdrawn(EngineUnavailable):
    """Background work's view of a shared engine was closed (its server stops): the work goes
    back to its queue."""

    code = "withdrawn"


class BaseModelNotServed(MacaronError):
    """The engine serves adapters only (the vLLM fleet): a request must name one."""

    code = "base_model_not_served"


class ContextLengthExceeded(MacaronError):
    """The turn's context (system prompt, history and message) is longer than the model takes."""

    code = "context_length_exceeded"


class EngineError(MacaronError):
    """The engine failed while generating this request; other requests keep being served."""

    code = "engine_error"


class InvalidApiKey(MacaronError):
    """No key, a malformed key, an unknown key, or a revoked key: all look the same outside."""

    code = "unauthenticated"


class Forbidden(MacaronError):
    """The key is valid but lacks the scope this action needs (``admin``, say)."""

    code = "forbidden"


class InvalidFrame(MacaronError):
    """A WebSocket frame or HTTP body that is not valid for protocol v1."""

    code = "invalid_frame"


class UnsupportedParameter(InvalidFrame):
    """A request parameter this server does not apply, named in the message (refused rather
    than silently ignored)."""

    code = "unsupported_parameter"


class PayloadTooLarge(InvalidFrame):
    """An HTTP body over the server's limit (it is not read further)."""

    code = "payload_too_large"


class ConversationNotFound(MacaronError):
    """No such conversation for this tenant (another tenant's looks exactly the same)."""

    code = "conversation_not_found"


class TurnNotFound(MacaronError):
    """No such turn in this tenant's conversations."""

    code = "turn_not_found"


class TurnInFlight(MacaronError):
    """The conversation already has a turn being answered; one at a time."""

    code = "turn_in_flight"
    retryable = True


class RateLimited(MacaronError):
    """Too many turns per minute for this key."""

    code = "rate_limited"
    retryable = True


class RateLimitUnavailable(MacaronError):
    """The shared rate limit's storage (Redis) cannot be reached: the turn is refused, not let
    through uncounted."""

    code = "unavailable"
    retryable = True


class TooManyConnections(MacaronError):
    """The tenant has as many open connections as it may."""

    code = "too_many_connections"
    retryable = True


class NoActiveRelease(MacaronError):
    """The registry has no active release to serve."""

    code = "no_active_release"


class ContractInvalid(MacaronError):
    """A contract file cannot be read, is not YAML, or does not describe a valid contract."""

    code = "contract_invalid"


class ContractChanged(ContractInvalid):
    """A contract version's tasks differ from the tasks that version was sealed or scored
    with: a changed task needs a new contract version, or outcomes of two different tasks
    would be compared as one."""

    code = "contract_changed"


class TaskBankInvalid(MacaronError):
    """A task bank file cannot be read, is not YAML, or does not describe valid tasks."""

    code = "task_bank_invalid"


class UnknownFilterVersion(MacaronError):
    """No experience filter rules of that version."""

    code = "unknown_filter_version"


class RangeOutsideLog(MacaronError):
    """A log range that starts or ends where the log has no position."""

    code = "range_outside_log"


class BackfillRunning(MacaronError):
    """The same backfill is running in another process."""

    code = "backfill_running"


class TriggerBehind(MacaronError):
    """The training trigger has not read the log as far as asked (are the processors up?)."""

    code = "trigger_behind"
    retryable = True


class NothingToTrain(MacaronError):
    """A training run was asked for with no SFT examples and no preference pairs."""

    code = "nothing_to_train"


class TrainingInFlight(MacaronError):
    """A specialist's run is queued or running: the next one waits for it."""

    code = "training_in_flight"


class PromotionInProgress(MacaronError):
    """One promotion (or rollback) is carried out at a time."""

    code = "promotion_in_progress"
    retryable = True


class ReleaseNotFound(MacaronError):
    code = "release_not_found"


class PromotionFailed(MacaronError):
    """Loading a release's adapters or its canary request failed; the old release serves on."""

    code = "promotion_failed"


class HarnessInvalid(MacaronError):
    """A harness is malformed, names a tool or GenUI catalogue this server does not know, or
    its stored content does not hash to its address."""

    code = "harness_invalid"


class HcpUnsupported(HarnessInvalid):
    """A harness needs an HCP version this server does not speak."""

    code = "hcp_unsupported"


class HarnessNotFound(MacaronError):
    """No harness version by that name is registered."""

    code = "harness_not_found"


class GrammarInvalid(MacaronError):
    """An output constraint's JSON Schema is not a schema, or the grammar library cannot
    compile it."""

    code = "grammar_invalid"


class GrammarUnbounded(GrammarInvalid):
    """An output constraint's schema lets an answer grow without bound (an array without
    ``maxItems``, a string without ``maxLength``): it could not end within its token budget."""

    code = "grammar_unbounded"


class ConstraintUnsupported(MacaronError):
    """The engine cannot enforce this output constraint at decode time."""

    code = "constraint_unsupported"


class MasterKeyInvalid(ConfigError):
    """The master key that wraps tenants' data keys is missing, malformed, or not the one the
    stored data keys were wrapped with: nothing starts, and nothing is written in plaintext."""

    code = "master_key_invalid"


class TenantNotFound(MacaronError):
    """No such tenant (tenants come with their API keys)."""

    code = "tenant_not_found"


class TenantForgotten(MacaronError):
    """The tenant was forgotten: its data key is destroyed, and nothing more of it is stored."""

    code = "tenant_forgotten"


def validation_problems(exc: ValidationError, whole: str, limit: int = 5) -> str:
    """The first ``limit`` problems of a pydantic validation error as ``path: message``, joined
    by ``; `` (``whole`` names the path of a problem with the value as a whole)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or whole}: {e['msg']}"
        for e in exc.errors()[:limit]
    )
