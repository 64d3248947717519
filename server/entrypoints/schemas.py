"""The JSON Schemas clients and models are held to, exported from the pydantic models so the
documents in ``docs/schema/`` cannot drift from the code (a test compares them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.harness.genui import catalogue_schema
from core.harness.hcp import hcp_schema
from server.entrypoints.protocol import json_schema as protocol_schema

SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "protocol-v1.json": protocol_schema,
    "hcp-1.json": hcp_schema,
    "genui-1.json": catalogue_schema,
}


def render(name: str) -> str:
    return json.dumps(SCHEMAS[name](), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def export(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SCHEMAS:
        (folder / name).write_text(render(name))
        written.append(folder / name)
    return written
