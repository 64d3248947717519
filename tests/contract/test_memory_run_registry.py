"""The run-registry contract against the in-memory registry, which unit tests run over."""

from __future__ import annotations

import pytest

from core.run_registry import RunRegistry
from infra.memory_registry import InMemoryRunRegistry
from tests.contract.run_registry_contract import RunRegistryContract


class TestInMemoryRunRegistry(RunRegistryContract):
    @pytest.fixture
    def registry(self) -> RunRegistry:
        return InMemoryRunRegistry()
