"""A task: one prompt, the specialist that serves it, a checker that tells a correct answer
(its kinds are data here; ``learners.evaluation.checkers`` runs them) and a reference answer.
Contracts (``core.contract``) and task banks (``learners.tasks``) are made of them.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from core.canonical import canonical_json, sha256_hex
from core.routing import SpecialistName


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExactChecker(_Frozen):
    """Passes when the output equals ``expected``, both stripped of surrounding whitespace."""

    kind: Literal["exact"]
    expected: str


class _Pattern(_Frozen):
    """A checker with a regular expression the output must match (``re.search``, ``DOTALL``)."""

    pattern: str = Field(min_length=1)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return pattern


class RegexChecker(_Pattern):
    """Passes when ``pattern`` matches anywhere in the output."""

    kind: Literal["regex"]


class GenUIChecker(_Frozen):
    """Passes when the output is a valid GenUI tree whose text contains each of ``must_contain``
    and which shows each of ``values`` (a number in the tree, or in its text; contract v3 on)."""

    kind: Literal["genui"]
    must_contain: list[str] = Field(default_factory=list)
    values: list[float] = Field(default_factory=list)


Operator = Literal["+", "-", "*", "/", "//", "%", "**"]


class Calculation(_Frozen):
    """What a calculator call's expression must do itself (contract v5 on): use each of
    ``operands`` as a number literal and each of ``operators``. A result alone is what the
    model could have worked out and written as one number (``calculator("540")`` has the value
    of "Multiply 45 by 12", and the tool did nothing)."""

    operands: list[float] = Field(min_length=1)
    operators: list[Operator] = Field(min_length=1)


class ToolCallChecker(_Frozen):
    """Passes when the output is a valid call of ``tool`` whose arguments include ``args``, whose
    string arguments contain the words ``contains`` names, whose result on a fresh tool
    state includes ``result`` (a calculator's value: ``250-19`` and ``-19+250`` both pass
    ``{value: 231}``), and, for a calculator call, whose expression makes the ``calculation``
    (its operands and operators). ``contains`` and ``result`` came with contract v3, so content
    is checked, not only the tool's name; ``calculation`` with v5, so the tool does the sum."""

    kind: Literal["tool_call"]
    tool: str = Field(min_length=1)
    args: dict[str, JsonValue] = Field(default_factory=dict)
    contains: dict[str, list[str]] = Field(default_factory=dict)
    result: dict[str, JsonValue] = Field(default_factory=dict)
    calculation: Calculation | None = None

    @model_validator(mode="after")
    def _calculation_is_a_calculators(self) -> ToolCallChecker:
        if self.calculation is not None and self.tool != "calculator":
            raise ValueError("only a calculator call has a calculation to check")
        return self


class NoCallChecker(_Pattern):
    """Passes when the output is text, not a tool call, and matches ``pattern``: a request no
    offered tool serves, or one the model answers best itself, judged as strictly as a call
    (contract v5 on)."""

    kind: Literal["no_call"]


class PythonTestsChecker(_Frozen):
    """Passes when the answer's code followed by ``tests`` runs without error in a sandbox."""

    kind: Literal["python_tests"]
    tests: str = Field(min_length=1)


Checker = Annotated[
    ExactChecker
    | RegexChecker
    | GenUIChecker
    | ToolCallChecker
    | NoCallChecker
    | PythonTestsChecker,
    Field(discriminator="kind"),
]


class Task(_Frozen):
    """One prompt, served by ``specialist``, and how to tell a correct answer.

    ``reference`` is a correct answer: the simulator's oracle uses it as the user's edit, so it
    becomes training data for bank tasks (never for contract tasks, which are held out).
    """

    id: str = Field(pattern=r"^[a-z0-9-]+$", max_length=100)
    specialist: SpecialistName
    prompt: str = Field(min_length=1)
    checker: Checker
    reference: str = Field(min_length=1)

    def key(self) -> str:
        """The task by its content: ``id:sha256`` of the whole task (prompt, checker and
        reference). Stored outcomes are keyed by it, so an outcome is only ever reused for
        the task it was got on, wherever that task stands in its suite."""
        return f"{self.id}:{sha256_hex(canonical_json(self.model_dump(mode='json')))}"


NEAR_DUPLICATE = 0.6
"""Word overlap (Jaccard) from which two prompts count as the same task asked again."""


@functools.lru_cache(maxsize=4096)
def prompt_words(prompt: str) -> frozenset[str]:
    """A prompt's words, case and punctuation dropped and numbers masked: what near-duplicates
    share."""
    return frozenset(re.sub(r"\d+", "#", re.sub(r"[^\w\s]", " ", prompt.casefold())).split())


def word_overlap(a: frozenset[str], b: frozenset[str]) -> float:
    """Jaccard similarity of two prompts' ``prompt_words``."""
    return len(a & b) / len(a | b) if a | b else 1.0
