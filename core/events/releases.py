"""The events of the serving fleet's releases: a specialist added, a release promoted, a
promotion refused, a rollback."""

from __future__ import annotations

from uuid import UUID

from pydantic import Field

from core.events.envelope import EventPayload


class SpecialistAdded(EventPayload):
    """A specialist added at run time (``macaron specialist add``), on key ``specialists``: what
    it is for, and the example turns every router fit learns it from (beside the seed
    examples) while the active release's router knows it."""

    event_type = "SpecialistAdded"
    specialist: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
    description: str = Field(min_length=1, max_length=500)
    examples: tuple[str, ...] = Field(min_length=1, max_length=1000)


class ReleasePromoted(EventPayload):
    event_type = "ReleasePromoted"
    release_id: str
    parent_release_id: str | None
    run_id: UUID | None = None


class PromotionRejected(EventPayload):
    event_type = "PromotionRejected"
    run_id: UUID
    reason: str


class ReleaseRolledBack(EventPayload):
    event_type = "ReleaseRolledBack"
    from_release_id: str
    to_release_id: str
    reason: str
