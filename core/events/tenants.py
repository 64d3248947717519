"""The events of a tenant's standing."""

from __future__ import annotations

from core.events.envelope import EventPayload, Name

SYSTEM_TENANT = "system"
"""The tenant of the server's own events (releases, runs, rollouts): never forgotten."""


class TenantTrainingSet(EventPayload):
    """Whether a tenant's traffic may teach (the envelope's tenant): from this event on, the
    experience builder derives no training or routing record from a tenant set to ``False``.
    Tenants teach until they are set otherwise."""

    event_type = "TenantTrainingSet"
    training: bool


class TenantForgotten(EventPayload):
    """A tenant forgotten (``macaron tenants forget``): its data key is destroyed, so every
    event it wrote reads as ``Forgotten``; processors erase its rows when they meet this event.
    Stored under the ``system`` tenant, once per tenant (its id is derived from the tenant's)."""

    event_type = "TenantForgotten"
    tenant: Name
