"""GenUI component catalogue ``genui-1``: the one JSON object the ``genui`` specialist answers with.

The tree is checked here before anything is sent: ``parse_genui_output`` turns the model's raw text
into a ``GenUIResult`` whose errors are path-level (``children.2.rows.0: ...``) so they can be shown
to people and fed back to the model; an invalid tree is never sent, ``text_fallback`` is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

CATALOGUE_VERSION = "genui-1"
MAX_DEPTH = 12
"""Deepest component nesting accepted (the root is at depth 1)."""
MAX_COMPONENTS = 300
MAX_ERRORS = 20
FALLBACK_CHARS = 2000
"""Most characters of the answer that ``text_fallback`` shows."""

ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
ComponentId = Annotated[str, Field(pattern=ID_PATTERN)]
Label = Annotated[str, Field(min_length=1, max_length=200)]


class _Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _one_cell_error(value: object, handler: Callable[[object], object]) -> object:
    """Report a bad cell once, instead of once per member of the scalar union."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "cell_type", "cell must be a string, a finite number, a boolean or null"
        ) from None


Cell = Annotated[str | int | float | bool | None, WrapValidator(_one_cell_error)]


def _row_fits_columns(row: list[Cell], info: ValidationInfo) -> list[Cell]:
    columns = info.data.get("columns")
    if columns is not None and len(row) != len(columns):
        raise PydanticCustomError(
            "row_length",
            "row has {cells} cells; the table has {columns} columns",
            {"cells": len(row), "columns": len(columns)},
        )
    return row


class Series(_Node):
    name: Label
    values: list[float] = Field(max_length=100)


def _series_fits_labels(series: Series, info: ValidationInfo) -> Series:
    labels = info.data.get("labels")
    if labels is not None and len(series.values) != len(labels):
        raise PydanticCustomError(
            "series_length",
            "series has {values} values; the chart has {labels} labels",
            {"values": len(series.values), "labels": len(labels)},
        )
    return series


class Card(_Node):
    type: Literal["Card"]
    id: ComponentId | None = None
    title: str | None = Field(default=None, max_length=200)
    children: list[Component] = Field(max_length=50)


class Text(_Node):
    type: Literal["Text"]
    id: ComponentId | None = None
    text: str = Field(min_length=1, max_length=4000)


class Heading(_Node):
    type: Literal["Heading"]
    id: ComponentId | None = None
    text: Label
    level: int = Field(default=2, ge=1, le=4)


class Button(_Node):
    type: Literal["Button"]
    id: ComponentId
    label: str = Field(min_length=1, max_length=100)
    action: str = Field(default="click", min_length=1, max_length=100)


class List(_Node):
    type: Literal["List"]
    id: ComponentId | None = None
    items: list[Annotated[str, Field(max_length=1000)]] = Field(max_length=100)
    ordered: bool = False


class Table(_Node):
    type: Literal["Table"]
    id: ComponentId | None = None
    columns: list[Label] = Field(min_length=1, max_length=20)
    rows: list[Annotated[list[Cell], AfterValidator(_row_fits_columns)]] = Field(max_length=200)


class Input(_Node):
    type: Literal["Input"]
    id: ComponentId
    label: Label
    placeholder: str | None = Field(default=None, max_length=200)
    value: str | None = Field(default=None, max_length=4000)


class Select(_Node):
    type: Literal["Select"]
    id: ComponentId
    label: Label
    options: list[Label] = Field(min_length=1, max_length=50)
    value: str | None = None

    @field_validator("value")
    @classmethod
    def _value_is_an_option(cls, value: str | None, info: ValidationInfo) -> str | None:
        options = info.data.get("options")
        if value is not None and options is not None and value not in options:
            raise PydanticCustomError("select_value", "value is not one of the options")
        return value


FormChild = Annotated[Input | Select | Text | Heading, Field(discriminator="type")]


class Form(_Node):
    type: Literal["Form"]
    id: ComponentId
    children: list[FormChild] = Field(min_length=1, max_length=30)
    submit_label: str = Field(default="Submit", min_length=1, max_length=100)


class Chart(_Node):
    type: Literal["Chart"]
    id: ComponentId | None = None
    kind: Literal["bar", "line"]
    labels: list[Label] = Field(min_length=1, max_length=100)
    series: list[Annotated[Series, AfterValidator(_series_fits_labels)]] = Field(
        min_length=1, max_length=10
    )


Component = Annotated[
    Card | Text | Heading | Button | List | Table | Form | Input | Select | Chart,
    Field(discriminator="type"),
]
Card.model_rebuild()
_TREE: TypeAdapter[Component] = TypeAdapter(Component)
_TAGS = frozenset(
    ("Card", "Text", "Heading", "Button", "List", "Table", "Form", "Input", "Select", "Chart")
)
_INTERACTIVE = frozenset(("Button", "Form", "Input", "Select"))


def catalogue_schema() -> dict[str, Any]:
    """JSON Schema of one tree (its root is one component), for the specialist's prompt and docs."""
    schema = _TREE.json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Macaron GenUI catalogue {CATALOGUE_VERSION}",
        **schema,
    }


@dataclass(frozen=True)
class GenUIResult:
    """``tree`` is the normalised tree, set only when ``valid``; ``errors`` are path-level."""

    valid: bool
    tree: dict[str, JsonValue] | None
    errors: list[str]


def _invalid(errors: list[str]) -> GenUIResult:
    return GenUIResult(valid=False, tree=None, errors=errors[:MAX_ERRORS])


def validate_tree(tree: object) -> GenUIResult:
    """Check any JSON value against the catalogue; size limits first, so no input can recurse."""
    if not isinstance(tree, dict):
        return _invalid(["tree must be a JSON object with a type"])
    size_errors = _size_errors(tree)
    if size_errors:
        return _invalid(size_errors)
    try:
        root = _TREE.validate_python(tree)
    except ValidationError as exc:
        return _invalid([_describe(e["loc"], e["msg"]) for e in exc.errors()[:MAX_ERRORS]])
    except RecursionError:
        return _invalid([f"tree is nested deeper than {MAX_DEPTH}"])
    duplicates = _duplicate_id_errors(root)
    if duplicates:
        return _invalid(duplicates)
    return GenUIResult(valid=True, tree=root.model_dump(mode="json", exclude_none=True), errors=[])


def _size_errors(tree: dict[Any, Any]) -> list[str]:
    """Count components and measure nesting without recursion (the input may be 5000 deep).

    The walk stops one level past the limit, so a cyclic Python object cannot loop it forever.
    """
    count, depth = 0, 0
    stack: list[tuple[dict[Any, Any], int]] = [(tree, 1)]
    while stack:
        node, level = stack.pop()
        count += 1
        depth = max(depth, level)
        children = node.get("children")
        if isinstance(children, list) and level <= MAX_DEPTH:
            stack.extend((child, level + 1) for child in children if isinstance(child, dict))
    if depth > MAX_DEPTH:
        return [f"tree is nested deeper than {MAX_DEPTH}"]
    if count > MAX_COMPONENTS:
        return [f"tree has {count} components; at most {MAX_COMPONENTS}"]
    return []


def _describe(loc: tuple[int | str, ...], message: str) -> str:
    """Pydantic puts the union tag (``Card``) in the path; drop it so the path reads as JSON."""
    path = ".".join(str(part) for part in loc if part not in _TAGS) or "tree"
    return f"{path}: {message}"


def _duplicate_id_errors(root: _Node) -> list[str]:
    first_seen: dict[str, str] = {}
    errors: list[str] = []
    for path, node_id in _ids(root, ""):
        first = first_seen.setdefault(node_id, path)
        if first != path:
            errors.append(f"{path}: duplicate id {node_id!r}; first used at {first}")
    return errors


def _ids(node: _Node, prefix: str) -> Iterator[tuple[str, str]]:
    """Every id with its JSON path, in document order (a validated tree is at most 12 deep)."""
    node_id = getattr(node, "id", None)
    if node_id is not None:
        yield f"{prefix}id", node_id
    if isinstance(node, Card | Form):
        for index, child in enumerate(node.children):
            yield from _ids(child, f"{prefix}children.{index}.")


_FENCE = re.compile(r"^```(?:json)?[ \t]*\n(.*?)\n?```$", re.DOTALL)


def _unfence(text: str) -> str:
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    return fenced.group(1).strip() if fenced else stripped


def parse_genui_output(text: str) -> GenUIResult:
    """The specialist's raw output (JSON, optionally in a ```json fence) to a checked tree."""
    body = _unfence(text)
    try:
        data: Any = json.loads(body)
    except ValueError as exc:
        return _invalid([f"output is not JSON: {exc}"])
    except RecursionError:
        return _invalid([f"tree is nested deeper than {MAX_DEPTH}"])
    return validate_tree(data)


def text_fallback(text: str, result: GenUIResult) -> str:
    """What the user sees instead of an invalid tree: the problem, then the answer's text alone."""
    count = len(result.errors)
    summary = f"{count} problem{'' if count == 1 else 's'}"
    if result.errors:
        summary += f": {result.errors[0][:300]}"
    header = f"I could not render that view ({summary}). Here is the answer as text:\n"
    return header + _answer_text(text)[:FALLBACK_CHARS]


_JSON_TOKEN = re.compile(
    r'"((?:[^"\\]|\\.)*)"(\s*:)?|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)', re.DOTALL
)
_STRUCTURAL_KEYS = frozenset(("type", "id", "action", "kind", "level", "ordered"))


def _answer_text(text: str) -> str:
    """The readable values of a JSON-looking answer, one a line; prose is kept as it is.

    Tokens are scanned rather than parsed, so a truncated or malformed tree still yields its text.
    """
    body = _unfence(text)
    if not body.startswith(("{", "[")):
        return body
    lines: list[str] = []
    key = ""
    for token in _JSON_TOKEN.finditer(body):
        literal, colon, number = token.groups()
        if colon:
            key = literal
        elif key not in _STRUCTURAL_KEYS:
            lines.append(number if number is not None else _decode(literal))
    return "\n".join(lines)


def _decode(literal: str) -> str:
    try:
        decoded: str = json.loads(f'"{literal}"')
    except ValueError:
        return literal
    return decoded


def interactive_ids(tree: dict[str, JsonValue]) -> dict[str, str]:
    """Id -> type of every component a user can act on, so a ``ui_event`` can be checked."""
    found: dict[str, str] = {}
    stack: list[JsonValue] = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        kind, node_id, children = node.get("type"), node.get("id"), node.get("children")
        if kind in _INTERACTIVE and isinstance(kind, str) and isinstance(node_id, str):
            found[node_id] = kind
        if isinstance(children, list):
            stack.extend(children)
    return found
