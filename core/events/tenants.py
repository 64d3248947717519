"""The events of a tenant's standing."""

from __future__ import annotations

from core.events.envelope import EventPayload


class TenantTrainingSet(EventPayload):
    """Whether a tenant's traffic may teach (the envelope's tenant): from this event on, the
    experience builder derives no training or routing record from a tenant set to ``False``.
    Tenants teach until they are set otherwise."""

    event_type = "TenantTrainingSet"
    training: bool
