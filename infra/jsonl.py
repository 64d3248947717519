"""Reading JSON-lines data files: one pydantic model per non-blank line."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from core.errors import MacaronError

_M = TypeVar("_M", bound=BaseModel)


def load_jsonl(path: Path, model: type[_M], error: type[MacaronError]) -> list[_M]:
    """Each non-blank line of ``path`` validated as ``model``; ``error`` names the line that is
    not one (or why the file cannot be read)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read: {exc}") from exc
    found = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            found.append(model.model_validate_json(line))
        except ValidationError as exc:
            raise error(f"{path}:{number}: not a {model.__name__}: {exc}") from exc
    return found
