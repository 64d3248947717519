"""The engine contract against the local engine (the fleet's run is in test_vllm_fleet.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.local.engine import LocalEngine
from tests.contract.engine_contract import EngineContract


class TestLocalEngine(EngineContract):
    @pytest.fixture
    def model_dir(self, tiny_model: Path) -> Path:
        return tiny_model

    @pytest.fixture
    def engine(self, tiny_model: Path) -> Iterator[LocalEngine]:
        engine = LocalEngine(tiny_model)
        yield engine
        engine.close()
