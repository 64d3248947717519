"""The vLLM fleet maps vLLM's refusals by HTTP status and error type, never by message text."""

from __future__ import annotations

import pytest

from core.errors import EngineError, EngineOverloaded, MacaronError
from engines.vllm.errors import ReplicaLost, refusal


@pytest.mark.parametrize(
    ("status", "kind", "expected", "missing"),
    [
        (429, "TooManyRequests", EngineOverloaded, False),
        (404, "NotFoundError", ReplicaLost, True),
        (400, "NotFoundError", ReplicaLost, True),
        (500, "InternalServerError", ReplicaLost, False),
        (503, "ServiceUnavailable", ReplicaLost, False),
        (400, "BadRequestError", EngineError, False),
        (422, "", EngineError, False),
    ],
)
def test_refusals_by_status_and_type(
    status: int, kind: str, expected: type[Exception], missing: bool
) -> None:
    # The same message for every case: only status and type may decide.
    mapped = refusal(status, kind, "The model `coding@7` does not exist.", "http://r1")
    assert type(mapped) is expected
    if isinstance(mapped, ReplicaLost):
        assert mapped.adapter_missing is missing
    else:
        assert "http://r1" in str(mapped)


def test_retryable_refusals_say_so() -> None:
    busy, bad = refusal(429, "", "busy", "http://r1"), refusal(400, "BadRequestError", "x", "")
    assert isinstance(busy, MacaronError) and busy.retryable and busy.code == "overloaded"
    assert isinstance(bad, MacaronError) and not bad.retryable and bad.code == "engine_error"
