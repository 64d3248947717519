"""Upcasters: turn a stored payload of an old schema version into the current one, on read.

Stored events are never rewritten. Each upcaster lifts one version (``v`` to ``v + 1``) of one
event type; reading applies them in a chain until the payload reaches the version the code knows.
This module holds the registry and every registered upcaster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import UnknownSchemaVersion

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]


class UpcasterRegistry:
    def __init__(self) -> None:
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator: register ``fn`` as the upcaster of ``event_type`` from ``from_version``."""

        def decorate(fn: Upcaster) -> Upcaster:
            slot = (event_type, from_version)
            if slot in self._upcasters:
                raise ValueError(f"an upcaster for {event_type} v{from_version} already exists")
            self._upcasters[slot] = fn
            return fn

        return decorate

    def upcast(self, event_type: str, version: int, payload: Payload, target: int) -> Payload:
        """Lift ``payload`` from ``version`` to ``target``; a gap or a newer version is an error."""
        if version > target:
            raise UnknownSchemaVersion(
                f"{event_type} v{version} is newer than this code knows (v{target})"
            )
        while version < target:
            step = self._upcasters.get((event_type, version))
            if step is None:
                raise UnknownSchemaVersion(f"no upcaster for {event_type} from v{version}")
            payload = step(dict(payload))
            version += 1
        return payload


UPCASTERS = UpcasterRegistry()
"""The upcasters of this code's event catalogue."""


@UPCASTERS.register("TurnReceived", 1)
def _turn_received_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 had ``text`` and no client message id; the turn id stood in for it."""
    payload["content"] = payload.pop("text")
    payload.setdefault("client_msg_id", str(payload["turn_id"]))
    payload.setdefault("specialist_hint", None)
    return payload


@UPCASTERS.register("TurnReceived", 2)
def _turn_received_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 turns predate the harness: no release or harness stamp was recorded."""
    payload.setdefault("release_id", None)
    payload.setdefault("harness", None)
    return payload


@UPCASTERS.register("TurnReceived", 3)
def _turn_received_v3(payload: dict[str, Any]) -> dict[str, Any]:
    """v3 turns were never regenerations (regenerating was not recorded as a link)."""
    payload.setdefault("regenerates", None)
    return payload


@UPCASTERS.register("TurnReceived", 4)
def _turn_received_v4(payload: dict[str, Any]) -> dict[str, Any]:
    """v4 turns were sampled as their harness said."""
    payload.setdefault("decoding", None)
    return payload


@UPCASTERS.register("TurnReceived", 5)
def _turn_received_v5(payload: dict[str, Any]) -> dict[str, Any]:
    """v5 decodings were never a tool call or text: a client's format was enforced alone."""
    if isinstance(payload.get("decoding"), dict):
        payload["decoding"].setdefault("or_text", False)
    return payload


@UPCASTERS.register("TurnReceived", 6)
def _turn_received_v6(payload: dict[str, Any]) -> dict[str, Any]:
    """v6 turns did not record where their words came in."""
    payload.setdefault("front_end", None)
    return payload


@UPCASTERS.register("ExperienceRecorded", 1)
def _experience_recorded_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 records all came from turns."""
    payload.setdefault("rollout_group_id", None)
    return payload


@UPCASTERS.register("ExperienceRecorded", 2)
def _experience_recorded_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v2 records did not say their source (``core.experience.source_of`` tells it where it
    can)."""
    payload.setdefault("source", None)
    return payload


@UPCASTERS.register("RolloutSampled", 1)
def _rollout_sampled_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 samples were never swept: the first step could make any call of the harness."""
    payload.setdefault("first_call", None)
    return payload


@UPCASTERS.register("RouterDecided", 1)
def _router_decided_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 recorded no reason (unknown) and no context (the router read the message alone)."""
    payload.setdefault("reason", None)
    payload.setdefault("tool_callers", [])
    payload.setdefault("previous", None)
    return payload


@UPCASTERS.register("RouterEvaluated", 1)
def _router_evaluated_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 verdicts did not count the labels their run left out."""
    payload.setdefault("labels_left_out", 0)
    return payload
