"""Every event type this code knows, by name, and decoding a stored payload into its typed
model (upcast first)."""

from __future__ import annotations

from pydantic import ValidationError

from core.errors import InvalidEvent, UnknownEventType
from core.events.envelope import Envelope, EventPayload
from core.events.learning import (
    CandidateTrained,
    ContractEvaluated,
    ExperienceRecorded,
    HarnessProposed,
    RolloutSampled,
    RolloutScored,
    RouterEvaluated,
    RouterTrainingRequested,
    RoutingLabelled,
    TasksWritten,
    TrainingRequested,
    UnlearningRequested,
)
from core.events.releases import (
    PromotionRejected,
    ReleasePromoted,
    ReleaseRolledBack,
    SpecialistAdded,
)
from core.events.tenants import TenantForgotten, TenantTrainingSet
from core.events.turns import (
    ConversationStarted,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    RouterDecided,
    RoutingCorrected,
    TurnCompleted,
    TurnReceived,
)
from core.events.upcasters import UPCASTERS

CATALOGUE: dict[str, type[EventPayload]] = {
    cls.event_type: cls
    for cls in (
        ConversationStarted,
        TurnReceived,
        RouterDecided,
        HarnessActionExecuted,
        GenUIRendered,
        ModelResponded,
        TurnCompleted,
        FeedbackGiven,
        RoutingCorrected,
        TenantTrainingSet,
        TenantForgotten,
        ExperienceRecorded,
        RoutingLabelled,
        SpecialistAdded,
        RolloutSampled,
        RolloutScored,
        TasksWritten,
        TrainingRequested,
        RouterTrainingRequested,
        UnlearningRequested,
        RouterEvaluated,
        CandidateTrained,
        HarnessProposed,
        ContractEvaluated,
        ReleasePromoted,
        PromotionRejected,
        ReleaseRolledBack,
    )
}


def decode_payload(envelope: Envelope) -> EventPayload:
    """Upcast and validate the payload of a stored envelope into its current typed model."""
    cls = CATALOGUE.get(envelope.type)
    if cls is None:
        raise UnknownEventType(f"unknown event type {envelope.type!r}")
    payload = UPCASTERS.upcast(
        envelope.type, envelope.schema_version, dict(envelope.payload), cls.schema_version
    )
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        raise InvalidEvent(f"{envelope.type} v{cls.schema_version}: {exc}") from exc
