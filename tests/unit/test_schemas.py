"""The schema documents in docs/schema are what the code validates against."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.entrypoints.schemas import SCHEMAS, render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schema"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_exported_schema_matches_the_code(name: str) -> None:
    assert (DOCS / name).read_text() == render(name), "run `macaron schema` and commit"


def test_the_protocol_schema_names_every_frame() -> None:
    text = render("protocol-v1.json")
    for frame in (
        "hello",
        "user_turn",
        "feedback",
        "ui_event",
        "cancel",
        "ping",
        "ready",
        "turn_started",
        "token",
        "action",
        "genui",
        "turn_completed",
        "error",
        "pong",
    ):
        assert f'"const": "{frame}"' in text
