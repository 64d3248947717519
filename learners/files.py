"""The learners' data files (``DATA``), and reading one: a YAML document validated as a pydantic
model.

A document may start from another: ``extends: <file name>`` (a YAML file in the same folder,
which extends none) takes that file's top-level keys, and the document's own keys replace them
(whole: a ``rule`` given replaces the base's rule); it must name its own ``version``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from core.errors import MacaronError, validation_problems

_M = TypeVar("_M", bound=BaseModel)

DATA = Path(__file__).resolve().parent
"""Where the learners' data files lie: the contracts, the routing suites and seed examples."""


def load_yaml_model(path: Path, model: type[_M], error: type[MacaronError]) -> _M:
    """Read, parse and validate one YAML document as ``model``, raising ``error`` on failure."""
    data = _document(path, error)
    if isinstance(data, dict) and "extends" in data:
        base_name = data.pop("extends")
        if not isinstance(base_name, str) or not re.fullmatch(r"[\w-][\w.-]*\.ya?ml", base_name):
            raise error(f"{path}: extends names a YAML file in the same folder, not {base_name!r}")
        if "version" not in data:
            raise error(f"{path}: a file that extends another names its own version")
        base = _document(path.with_name(base_name), error)
        if not isinstance(base, dict) or "extends" in base:
            raise error(f"{path}: {base_name} must be a mapping that extends no other file")
        data = base | data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: {validation_problems(exc, 'document')}") from exc


def _document(path: Path, error: type[MacaronError]) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
        return yaml.load(text, Loader=yaml.CSafeLoader)  # libyaml, in PyYAML's wheels
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from exc
