"""HCP v1, the Harness Context Protocol: what the model receives for a turn and the grammar its
answer must follow.

A context is a versioned pydantic model (``HarnessContext``), so what the model saw can be
recorded, diffed and rebuilt from the log; ``hcp_schema`` exports its JSON Schema together with
the output grammar. Grammars: plain ``text``; a ``tool_call`` JSON object (agent); a ``genui``
component tree (genui).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from core.events import ChatMessage
from core.harness.actions import ToolCall, ToolSpec
from core.harness.artifact import HarnessVersion, OutputKind
from core.harness.genui import catalogue_schema

HCP_VERSION: Literal["hcp-1"] = "hcp-1"
HISTORY_TURNS = 8
"""Completed turns of the conversation the model sees (its history window)."""

_CATALOGUE_SUMMARY = (
    "Components (each an object with a type): Card{title?, children[]}, Text{text}, "
    "Heading{text, level 1-4}, Button{id, label, action}, List{items[], ordered}, "
    "Table{columns[], rows[][]}, Form{id, children[] of Input/Select/Text/Heading, submit_label}, "
    "Input{id, label, placeholder?, value?}, Select{id, label, options[], value?}, "
    'Chart{kind "bar"|"line", labels[], series[{name, values[]}]}. '
    'Example: {"type": "Card", "title": "Hi", "children": [{"type": "Text", "text": "Hello"}]}'
)


class HarnessContext(BaseModel):
    """Everything the model is given for one generation step of a turn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hcp_version: Literal["hcp-1"] = HCP_VERSION
    harness_version: str = Field(description="the registered harness, harness@N")
    specialist: str
    system_prompt: str
    grammars: tuple[OutputKind, ...] = Field(min_length=1)
    tools: tuple[ToolSpec, ...] = ()
    genui_catalogue: str | None = Field(default=None, description="catalogue version")
    exemplars: tuple[ChatMessage, ...] = Field(
        default=(), description="few-shot examples, shown before the history"
    )
    history: tuple[ChatMessage, ...] = ()
    scratch: tuple[ChatMessage, ...] = Field(
        default=(), description="this turn so far: tool calls and their results"
    )
    user: str

    def messages(self) -> list[dict[str, str]]:
        """The context as chat messages for the model's chat template."""
        system = self.system_prompt
        if self.tools:
            listed = "; ".join(
                f"{t.name}: {t.description} args {json.dumps(t.parameters.get('properties', {}))}"
                for t in self.tools
            )
            system += f"\nTools: {listed}"
        if self.genui_catalogue is not None:
            system += f"\n{_CATALOGUE_SUMMARY}"
        messages = [{"role": "system", "content": system}]
        messages += [{"role": m.role, "content": m.content} for m in self.exemplars]
        messages += [{"role": m.role, "content": m.content} for m in self.history]
        messages.append({"role": "user", "content": self.user})
        messages += [{"role": m.role, "content": m.content} for m in self.scratch]
        return messages


def build_context(
    harness: HarnessVersion, specialist: str, history: list[ChatMessage], user: str
) -> HarnessContext:
    """The context of one turn of ``specialist`` under ``harness``."""
    spec = harness.spec.for_specialist(specialist)
    exemplars = [
        message
        for shot in spec.exemplars
        for message in (
            ChatMessage(role="user", content=shot.user),
            ChatMessage(role="assistant", content=shot.assistant),
        )
    ]
    return HarnessContext(
        harness_version=harness.name,
        specialist=specialist,
        system_prompt=spec.system_prompt,
        grammars=spec.output,
        tools=harness.spec.tools if "tool_call" in spec.output else (),
        genui_catalogue=harness.spec.catalogue_version if "genui" in spec.output else None,
        exemplars=tuple(exemplars),
        history=tuple(history),
        user=user,
    )


def tool_call_of(text: str) -> ToolCall | None:
    """The tool call the model answered with, or ``None`` when the answer is not one."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        return ToolCall.model_validate_json(stripped)
    except ValidationError:
        return None


def looks_structured(prefix: str) -> bool:
    """Whether an answer beginning with ``prefix`` may be JSON (held back, not streamed)."""
    return prefix.lstrip().startswith(("{", "`"))


def hcp_schema() -> dict[str, Any]:
    """JSON Schema of HCP v1: the context model and the output grammar."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"Macaron Harness Context Protocol {HCP_VERSION}",
        "properties": {
            "context": HarnessContext.model_json_schema(),
            "output": {
                "text": {"type": "string"},
                "tool_call": TypeAdapter(ToolCall).json_schema(),
                "genui": catalogue_schema(),
            },
        },
    }
