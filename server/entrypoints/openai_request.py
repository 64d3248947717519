"""The OpenAI API's chat completion request as clients send it: the parameters this server
applies, and a typed refusal (``unsupported_parameter``, naming it) for those it does not."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictBool, model_validator

from core.errors import InvalidFrame, UnsupportedParameter
from core.events import RequestedDecoding
from server.entrypoints.openai_tools import (
    MAX_TOOLS,
    AssistantToolCall,
    ToolChoice,
    ToolDef,
    tool_decoding,
)
from server.entrypoints.protocol import MAX_CONTENT_CHARS, Text


class TextPart(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text"]
    text: Text = Field(max_length=MAX_CONTENT_CHARS)


class ChatCompletionMessage(BaseModel):
    """A message as the API sends it: content as a string or as a list of text parts;
    ``developer`` is the newer name of ``system``; an assistant message may carry the
    ``tool_calls`` it made (and then no content), a ``tool`` message a call's result."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(default=None, max_length=MAX_CONTENT_CHARS)
    tool_calls: list[AssistantToolCall] | None = Field(default=None, max_length=16)
    tool_call_id: str | None = Field(default=None, max_length=100)

    @model_validator(mode="after")
    def _well_formed(self) -> ChatCompletionMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except for an assistant's tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if len(self.text) > MAX_CONTENT_CHARS:
            raise ValueError(f"a message holds at most {MAX_CONTENT_CHARS} characters")
        return self

    @property
    def text(self) -> str:
        """The message as the model reads it: a call as the call it wrote, a tool's result
        as the harness shows its own (``Tool result: ...``)."""
        if isinstance(self.content, list):
            written = "".join(part.text for part in self.content)
        else:
            written = self.content or ""
        calls = [call.as_written() for call in self.tool_calls or []]
        written = "\n".join([written, *calls] if written else calls)
        return f"Tool result: {written}" if self.role == "tool" else written

    @property
    def chat_role(self) -> Literal["system", "user", "assistant"]:
        if self.role == "developer":
            return "system"
        return "user" if self.role == "tool" else self.role


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=2000)
    schema_: dict[str, JsonValue] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``text`` (the harness decides), ``json_object`` (a JSON value; the API says an
    object) or ``json_schema`` (a value valid against the schema, which must be
    bounded: see ``core.harness.grammars.unbounded_paths``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


NEUTRAL: dict[str, object] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "n": 1,
}
"""Parameters this server does not apply: accepted only at the value that changes nothing."""


class ChatCompletionRequest(BaseModel):
    """The fields we honour; a parameter we do not apply is refused by name
    (``unsupported_parameter``), and unknown fields are refused, never silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, max_length=100)
    messages: list[ChatCompletionMessage] = Field(min_length=1, max_length=200)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=200)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=8192)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**62)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    n: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _tool_results_follow_their_calls(self) -> ChatCompletionRequest:
        """A ``tool`` message answers the assistant's ``tool_calls`` just before it."""
        for before, message in zip([None, *self.messages], self.messages, strict=False):
            if message.role != "tool":
                continue
            if before is None or not (before.role == "tool" or before.tool_calls):
                raise ValueError("a tool message must follow an assistant message's tool_calls")
        return self

    def callable_tools(self) -> list[ToolDef] | None:
        """The tools an answer may call (``None`` with ``tool_choice`` none: text only)."""
        return None if self.tool_choice == "none" else self.tools

    def decoding(self) -> RequestedDecoding | None:
        """What the request asks of the sampling (``None``: nothing), refusing by name what
        this server does not apply."""
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise UnsupportedParameter(
                    f"{name} is not supported by this server (only {neutral!r})"
                )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > 4 or any(not s for s in stop):
            raise InvalidFrame("stop is up to 4 non-empty strings")
        asked = RequestedDecoding(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            **self._output(),
        )
        return None if asked == RequestedDecoding() else asked

    def _output(self) -> dict[str, Any]:
        wanted = self.response_format
        if self.tools:
            if wanted is not None and wanted.type != "text":
                raise UnsupportedParameter("response_format is not supported together with tools")
            return tool_decoding(self.tools, self.tool_choice)
        if self.tool_choice is not None:
            raise InvalidFrame("tool_choice needs tools")
        if wanted is None or wanted.type == "text":
            return {}
        if wanted.type == "json_object":
            return {"output": "json"}
        if wanted.json_schema is None:
            raise InvalidFrame("response_format of type json_schema needs json_schema")
        return {"output": "json_schema", "json_schema": wanted.json_schema.schema_}
