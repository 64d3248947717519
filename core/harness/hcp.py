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

from core.events import ChatMessage, HarnessStamp
from core.harness.actions import TOOLS, ToolCall, ToolSpec
from core.harness.genui import CATALOGUE_VERSION, catalogue_schema

HCP_VERSION: Literal["hcp-1"] = "hcp-1"
HARNESS_VERSION = "harness-1"
STAMP = HarnessStamp(harness_version=HARNESS_VERSION, hcp_version=HCP_VERSION)
HISTORY_TURNS = 8
"""Completed turns of the conversation the model sees (its history window)."""

Grammar = Literal["text", "tool_call", "genui"]

_PROMPTS: dict[str, str] = {
    "chat": "You are Macaron, a helpful, concise assistant.",
    "agent": (
        "You are Macaron's agent. You can use tools. To call one, answer with only a JSON "
        'object {"tool": NAME, "args": {...}} and nothing else; you then get its result. '
        "When you have what you need, answer the user in plain text."
    ),
    "coding": (
        "You are Macaron's coding assistant. Answer with correct, minimal code in fenced blocks "
        "and a short explanation."
    ),
    "genui": (
        "You are Macaron's interface designer. Answer with only one JSON object: a component "
        "tree from the catalogue below, and nothing else."
    ),
}
_GRAMMARS: dict[str, tuple[Grammar, ...]] = {
    "agent": ("text", "tool_call"),
    "genui": ("genui",),
}
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
    harness_version: str = HARNESS_VERSION
    specialist: str
    system_prompt: str
    grammars: tuple[Grammar, ...] = Field(min_length=1)
    tools: tuple[ToolSpec, ...] = ()
    genui_catalogue: str | None = Field(default=None, description="catalogue version")
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
        messages += [{"role": m.role, "content": m.content} for m in self.history]
        messages.append({"role": "user", "content": self.user})
        messages += [{"role": m.role, "content": m.content} for m in self.scratch]
        return messages


def build_context(specialist: str, history: list[ChatMessage], user: str) -> HarnessContext:
    grammars = _GRAMMARS.get(specialist, ("text",))
    return HarnessContext(
        specialist=specialist,
        system_prompt=_PROMPTS.get(specialist, _PROMPTS["chat"]),
        grammars=grammars,
        tools=TOOLS if "tool_call" in grammars else (),
        genui_catalogue=CATALOGUE_VERSION if "genui" in grammars else None,
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
