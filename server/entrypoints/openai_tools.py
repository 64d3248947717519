"""Client-side functions in the OpenAI API (``tools``, ``tool_choice``): the client's tools are
told to the model like the harness's own, a call is decoded under the bounded schema of one of
them (``core.harness.grammars.tool_call_schema``, the grammar the agent's tools use), and the
answer goes back as OpenAI ``tool_calls``: the server never runs a client's function.

- ``tool_choice`` ``auto`` (the default with tools): a call or plain text, as the model likes;
  ``required``: a call of one of the tools; ``{"type": "function", "function": {"name"}}``: a
  call of that one; ``none``: text, the tools only described.
- An assistant message's ``tool_calls`` are shown to the model as the calls it wrote
  (``{"tool", "args"}``) and a ``tool`` message as ``Tool result: ...``, as the harness shows
  its own actions, so a conversation that goes on after a call reads like an agent's turn.
- At most one call per answer (``parallel_tool_calls`` is accepted either way).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool

from core.errors import InvalidFrame
from core.events import ChatMessage
from core.harness.actions import ToolSpec
from core.harness.grammars import tool_call_schema
from core.harness.hcp import tool_call_of

MAX_TOOLS = 32
NAME = r"^[A-Za-z0-9_-]{1,64}$"


def _no_parameters() -> dict[str, JsonValue]:
    return {"type": "object", "properties": {}}


class FunctionDef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME)
    description: str = Field(default="", max_length=1000)
    parameters: dict[str, JsonValue] = Field(default_factory=_no_parameters)
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME)
    arguments: str = Field(max_length=20_000)


class AssistantToolCall(BaseModel):
    """A call an earlier answer made, as the client sends it back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=100)
    type: Literal["function"]
    function: CalledFunction

    def as_written(self) -> str:
        """The call as the model writes one (``{"tool", "args"}``)."""
        try:
            args = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        return json.dumps({"tool": self.function.name, "args": args})


def specs(tools: list[ToolDef]) -> list[ToolSpec]:
    return [
        ToolSpec(
            name=t.function.name,
            description=t.function.description,
            parameters=t.function.parameters,
        )
        for t in tools
    ]


def described(tools: list[ToolDef]) -> ChatMessage:
    """The system message that tells the model the client's tools and how to call one."""
    listed = "; ".join(
        f"{t.name}: {t.description} args {json.dumps(t.parameters.get('properties', {}))}"
        for t in specs(tools)
    )
    return ChatMessage(
        role="system",
        content=f"Tools: {listed}\n"
        'To call a tool, answer only with {"tool": NAME, "args": {...}}.',
    )


def tool_decoding(tools: list[ToolDef], choice: ToolChoice | None) -> dict[str, Any]:
    """The output a request with ``tools`` asks for (the chat service checks it before the turn
    is recorded: ``ChatService.check_output``)."""
    choice = choice or "auto"
    if choice == "none":
        return {}
    chosen = specs(tools)
    if isinstance(choice, NamedToolChoice):
        chosen = [s for s in chosen if s.name == choice.function.name]
        if not chosen:
            raise InvalidFrame(f"tool_choice names {choice.function.name!r}, not one of tools")
    schema = tool_call_schema(chosen)
    return {"output": "json_schema", "json_schema": schema, "or_text": choice == "auto"}


def answer_message(
    text: str, tools: list[ToolDef] | None, call_id: str
) -> tuple[dict[str, Any], str | None]:
    """The assistant message for ``text``: a ``tool_calls`` message when it is a call of one of
    ``tools`` (with finish reason ``tool_calls``), else text (``None``: the turn's own)."""
    call = tool_call_of(text) if tools else None
    if call is None or call.tool not in {t.function.name for t in tools or []}:
        return {"role": "assistant", "content": text}, None
    called = {
        "id": call_id,
        "type": "function",
        "function": {"name": call.tool, "arguments": json.dumps(call.args)},
    }
    return {"role": "assistant", "content": None, "tool_calls": [called]}, "tool_calls"
