"""The harness as data: a versioned, content-addressed half of a release.

A ``HarnessSpec`` holds, per specialist, the system prompt, few-shot exemplars, the output kinds
the answer may take and whether their grammar is enforced at decode time, and the decoding
settings; beside them the tool specs, the GenUI catalogue version and the HCP version it speaks.
Its address is the sha256 of its canonical JSON. The registry numbers the versions it stores
(``harness@N``, immutable, each naming its parent); ``harness@0`` is ``root_harness()``, made
from the prompts the server had before harnesses were data, so the root release behaves as
before. Untrusted input goes through ``harness_from``, which raises typed errors only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from core.canonical import canonical_json, sha256_hex
from core.errors import HarnessInvalid, HarnessNotFound, HcpUnsupported, validation_problems
from core.events import HarnessStamp
from core.harness.actions import TOOLS, ToolSpec
from core.harness.genui import CATALOGUE_VERSION

SUPPORTED_HCP: tuple[str, ...] = ("hcp-1",)
"""The HCP versions this server speaks; a harness needing another is refused."""
SUPPORTED_CATALOGUES: tuple[str, ...] = (CATALOGUE_VERSION,)
LEGACY_HARNESS = "harness-1"
"""What releases named their harness before harnesses were data: the same constants as
``harness@0``, so it is read as ``harness@0``."""
MAX_EXEMPLARS = 8
MAX_EXEMPLAR_CHARS = 4000
FALLBACK_SPECIALIST = "chat"
"""A specialist the harness does not name is served with this one's harness."""

OutputKind = Literal["text", "tool_call", "genui"]
ToolChoice = Literal["auto", "required"]
_REF = re.compile(r"harness@([0-9]{1,9})")


class Exemplar(BaseModel):
    """One few-shot example: shown to the model as a user turn and its answer, before history."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str = Field(min_length=1, max_length=MAX_EXEMPLAR_CHARS)
    assistant: str = Field(min_length=1, max_length=MAX_EXEMPLAR_CHARS)


class Decoding(BaseModel):
    """How a specialist's answers are sampled (the server's ``max_new_tokens`` stays a cap)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=256, ge=1, le=8192)


class SpecialistHarness(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    system_prompt: str = Field(min_length=1, max_length=8000)
    exemplars: tuple[Exemplar, ...] = Field(default=(), max_length=MAX_EXEMPLARS)
    output: tuple[OutputKind, ...] = Field(default=("text",), min_length=1, max_length=3)
    enforce_grammar: bool = Field(default=False, description="constrain decoding to the output")
    tool_choice: ToolChoice = Field(
        default="auto",
        description="'required': a turn's first step must call a tool (by construction when the "
        "grammar is enforced); later steps, after a tool result, may answer in text",
    )
    decoding: Decoding = Decoding()

    @field_validator("output")
    @classmethod
    def _distinct(cls, value: tuple[OutputKind, ...]) -> tuple[OutputKind, ...]:
        if len(set(value)) != len(value):
            raise ValueError("output kinds must be distinct")
        return value

    @model_validator(mode="after")
    def _calls_if_required(self) -> SpecialistHarness:
        if self.tool_choice == "required" and "tool_call" not in self.output:
            raise ValueError("tool_choice 'required' needs the output kind tool_call")
        return self

    @model_serializer(mode="wrap")
    def _omit_defaults_added_later(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Fields added after harness@0 was stored are left out at their default, so the
        content, and the address, of every stored version stays what it was."""
        data = handler(self)
        if isinstance(data, dict) and data.get("tool_choice") == "auto":
            del data["tool_choice"]
        return data


class HarnessSpec(BaseModel):
    """One harness version's content; its ``address`` is what the registry stores it under."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hcp_version: str = Field(pattern=r"^hcp-[0-9]{1,6}$")
    catalogue_version: str = Field(min_length=1, max_length=100)
    tools: tuple[ToolSpec, ...] = Field(default=(), max_length=64)
    specialists: dict[str, SpecialistHarness] = Field(min_length=1, max_length=64)

    @field_validator("hcp_version")
    @classmethod
    def _spoken(cls, value: str) -> str:
        if value not in SUPPORTED_HCP:
            raise HcpUnsupported(
                f"the harness speaks {value}; this server speaks {', '.join(SUPPORTED_HCP)}"
            )
        return value

    @model_validator(mode="after")
    def _known(self) -> HarnessSpec:
        if self.catalogue_version not in SUPPORTED_CATALOGUES:
            raise HarnessInvalid(
                f"unknown GenUI catalogue {self.catalogue_version!r}; "
                f"known: {', '.join(SUPPORTED_CATALOGUES)}"
            )
        known = {tool.name for tool in TOOLS}
        names = [tool.name for tool in self.tools]
        unknown = sorted(set(names) - known)
        if unknown:
            raise HarnessInvalid(f"unknown tools {', '.join(unknown)}; known: {sorted(known)}")
        if len(set(names)) != len(names):
            raise HarnessInvalid("each tool may be listed once")
        if FALLBACK_SPECIALIST not in self.specialists:
            raise HarnessInvalid(f"the harness must name the {FALLBACK_SPECIALIST!r} specialist")
        calls = [name for name, s in self.specialists.items() if "tool_call" in s.output]
        if calls and not self.tools:
            raise HarnessInvalid(f"{', '.join(calls)} may call tools, but the harness has none")
        return self

    @property
    def address(self) -> str:
        """sha256 of the canonical JSON: the same content, the same address."""
        return sha256_hex(canonical_json(self.model_dump(mode="json")))

    def for_specialist(self, specialist: str) -> SpecialistHarness:
        return self.specialists.get(specialist, self.specialists[FALLBACK_SPECIALIST])


def harness_from(data: Mapping[str, Any]) -> HarnessSpec:
    """A harness spec from untrusted JSON: ``HarnessInvalid`` or ``HcpUnsupported`` if it is
    not one this server can serve."""
    try:
        return HarnessSpec.model_validate(data)
    except ValidationError as exc:
        raise HarnessInvalid(f"invalid harness: {validation_problems(exc, 'harness')}") from exc


class HarnessVersion(BaseModel):
    """A registered harness: its number (``harness@N``), address, parent and content."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    parent_version: int | None
    spec: HarnessSpec

    @property
    def name(self) -> str:
        return harness_name(self.version)

    @property
    def stamp(self) -> HarnessStamp:
        """What every event of a turn records of the harness it ran under."""
        return HarnessStamp(harness_version=self.name, hcp_version=self.spec.hcp_version)


def harness_fields(spec: HarnessSpec) -> dict[str, str]:
    """The spec as ``path: value`` lines (``specialists.agent.decoding.temperature: 0.7``):
    tools keyed by name, exemplars by position, lists of words joined, JSON values as JSON."""
    data = spec.model_dump(mode="json")
    data["tools"] = {tool.pop("name"): tool for tool in data["tools"]}
    fields: dict[str, str] = {}
    _flatten(data, "", fields)
    return fields


def _flatten(value: Any, path: str, into: dict[str, str]) -> None:
    if isinstance(value, dict) and not path.endswith(".parameters"):
        for key, item in value.items():
            _flatten(item, f"{path}.{key}" if path else key, into)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for index, item in enumerate(value):
            _flatten(item, f"{path}.{index}", into)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        into[path] = ", ".join(value)
    else:
        into[path] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def harness_diff(old: HarnessSpec, new: HarnessSpec) -> list[tuple[str, str | None, str | None]]:
    """What changed from ``old`` to ``new``: ``(path, old value, new value)`` for every field
    that differs, ``None`` where a side lacks it; sorted by path."""
    before, after = harness_fields(old), harness_fields(new)
    return [
        (path, before.get(path), after.get(path))
        for path in sorted(before.keys() | after.keys())
        if before.get(path) != after.get(path)
    ]


def harness_name(version: int) -> str:
    return f"harness@{version}"


def harness_number(ref: str) -> int:
    """The version number a release's harness reference names (``harness@3`` is 3; the legacy
    ``harness-1`` is 0)."""
    if ref == LEGACY_HARNESS:
        return 0
    match = _REF.fullmatch(ref)
    if match is None:
        raise HarnessNotFound(f"{ref!r} names no harness version: use harness@N")
    return int(match[1])


def root_version() -> HarnessVersion:
    """``harness@0`` as the registry stores it (for code that runs without the registry)."""
    spec = root_harness()
    return HarnessVersion(version=0, sha256=spec.address, parent_version=None, spec=spec)


def root_harness() -> HarnessSpec:
    """``harness@0``: the prompts, output kinds and sampling the server used before harnesses
    were data."""
    return HarnessSpec(
        hcp_version="hcp-1",
        catalogue_version=CATALOGUE_VERSION,
        tools=TOOLS,
        specialists={
            "chat": SpecialistHarness(
                system_prompt="You are Macaron, a helpful, concise assistant."
            ),
            "agent": SpecialistHarness(
                system_prompt=(
                    "You are Macaron's agent. You can use tools. To call one, answer with only a "
                    'JSON object {"tool": NAME, "args": {...}} and nothing else; you then get its '
                    "result. When you have what you need, answer the user in plain text."
                ),
                output=("text", "tool_call"),
            ),
            "coding": SpecialistHarness(
                system_prompt=(
                    "You are Macaron's coding assistant. Answer with correct, minimal code in "
                    "fenced blocks and a short explanation."
                )
            ),
            "genui": SpecialistHarness(
                system_prompt=(
                    "You are Macaron's interface designer. Answer with only one JSON object: a "
                    "component tree from the catalogue below, and nothing else."
                ),
                output=("genui",),
            ),
        },
    )
