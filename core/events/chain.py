"""The per-key hash chain: each event's hash covers its content and the previous hash of its key.

Changing, removing or reordering a stored event breaks the chain from that event on, which
``verify_chain`` reports with the key, sequence and reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from core.events.envelope import Envelope

ViolationKind = Literal["hash_mismatch", "prev_hash_mismatch", "sequence_gap"]


@dataclass(frozen=True)
class ChainViolation:
    key: str
    sequence: int
    event_id: UUID
    kind: ViolationKind

    def __str__(self) -> str:
        return f"{self.kind} at key {self.key!r} sequence {self.sequence} (event {self.event_id})"


def verify_chain(envelopes: Iterable[Envelope]) -> list[ChainViolation]:
    """Check every event's hash and link, given events in per-key order.

    An exact repeat of the event just seen on its key (as at-least-once delivery can give) is
    skipped, not reported; a changed copy under the same id is reported.
    """
    heads: dict[str, tuple[int, str, UUID]] = {}
    violations: list[ChainViolation] = []
    for env in envelopes:
        head = heads.get(env.key)
        if head == (env.sequence, env.hash, env.event_id) and env.computed_hash() == env.hash:
            continue
        expected_seq, expected_prev = (1, None) if head is None else (head[0] + 1, head[1])

        def report(kind: ViolationKind, env: Envelope = env) -> None:
            violations.append(ChainViolation(env.key, env.sequence, env.event_id, kind))

        if env.computed_hash() != env.hash:
            report("hash_mismatch")
        if env.sequence != expected_seq:
            report("sequence_gap")
        elif env.prev_hash != expected_prev:
            report("prev_hash_mismatch")
        heads[env.key] = (env.sequence, env.hash, env.event_id)
    return violations
