"""The event-log contract against the in-memory log, which unit tests run the server over."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from core.events.privacy import Cipher
from core.log import EventLog, RecordedEvent
from infra.memory import InMemoryDataKeys, InMemoryEventLog
from tests.contract.eventlog_contract import EventLogContract


class TestInMemoryEventLog(EventLogContract):
    @pytest.fixture
    def log(self) -> Iterator[InMemoryEventLog]:
        self.keys = InMemoryDataKeys()
        log = InMemoryEventLog(Cipher(self.keys))
        yield log
        log.close()

    def inject(self, log: EventLog, envelope: dict[str, Any]) -> None:
        assert isinstance(log, InMemoryEventLog)
        log.store_raw(envelope)

    def tamper(self, log: EventLog, record: RecordedEvent, payload: dict[str, Any]) -> None:
        """The list cannot be rewritten through the log; the attacker stores a forged copy."""
        assert isinstance(log, InMemoryEventLog)
        log.store_raw({**record.envelope.to_json(), "payload": payload})
