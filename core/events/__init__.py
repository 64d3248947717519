"""Event catalogue v1, by area: the envelope and its hashing (``envelope``, ``chain``), the
domain events of conversations (``turns``), tenants (``tenants``), the learning loop
(``learning``) and releases (``releases``), the upcasters of old schema versions
(``upcasters``), and decoding a stored payload (``catalogue``). Callers import the names from
here."""

from core.events.catalogue import CATALOGUE, decode_payload
from core.events.envelope import (
    Envelope,
    EventPayload,
    Hash,
    Name,
    NewEvent,
    Sealed,
    UtcTime,
    chain_hash,
    content_digest,
    format_time,
    utc_now,
)
from core.events.learning import (
    CandidateTrained,
    ContractEvaluated,
    ExperienceRecorded,
    ExperienceSource,
    HarnessProposed,
    RolloutSampled,
    RolloutScored,
    RolloutStep,
    RouterEvaluated,
    RouterTrainingRequested,
    RoutingLabelled,
    RoutingSource,
    TrainingRequested,
)
from core.events.releases import (
    PromotionRejected,
    ReleasePromoted,
    ReleaseRolledBack,
    SpecialistAdded,
)
from core.events.tenants import TenantTrainingSet
from core.events.turns import (
    ChatMessage,
    ConversationStarted,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    HarnessStamp,
    ModelResponded,
    RequestedDecoding,
    RouterDecided,
    RoutingCorrected,
    TurnCompleted,
    TurnReceived,
)
from core.events.upcasters import UPCASTERS

__all__ = [
    "CATALOGUE",
    "UPCASTERS",
    "CandidateTrained",
    "ChatMessage",
    "ContractEvaluated",
    "ConversationStarted",
    "Envelope",
    "EventPayload",
    "ExperienceRecorded",
    "ExperienceSource",
    "FeedbackGiven",
    "GenUIRendered",
    "HarnessActionExecuted",
    "HarnessProposed",
    "HarnessStamp",
    "Hash",
    "ModelResponded",
    "Name",
    "NewEvent",
    "PromotionRejected",
    "ReleasePromoted",
    "ReleaseRolledBack",
    "RequestedDecoding",
    "RolloutSampled",
    "RolloutScored",
    "RolloutStep",
    "RouterDecided",
    "RouterEvaluated",
    "RouterTrainingRequested",
    "RoutingCorrected",
    "RoutingLabelled",
    "RoutingSource",
    "Sealed",
    "SpecialistAdded",
    "TenantTrainingSet",
    "TrainingRequested",
    "TurnCompleted",
    "TurnReceived",
    "UtcTime",
    "chain_hash",
    "content_digest",
    "decode_payload",
    "format_time",
    "utc_now",
]
