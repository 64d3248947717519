"""Reading the learners' data files: one YAML document validated as a pydantic model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from core.errors import MacaronError, validation_problems

_M = TypeVar("_M", bound=BaseModel)


def load_yaml_model(path: Path, model: type[_M], error: type[MacaronError]) -> _M:
    """Read, parse and validate one YAML document as ``model``, raising ``error`` on failure."""
    try:
        text = path.read_text(encoding="utf-8")
        data: Any = yaml.load(text, Loader=yaml.CSafeLoader)  # libyaml, in PyYAML's wheels
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: {validation_problems(exc, 'document')}") from exc
