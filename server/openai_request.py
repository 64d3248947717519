"""The OpenAI API's chat completion request as clients send it: the parameters this server
applies, and a typed refusal (``unsupported_parameter``, naming it) for those it does not."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from core.errors import InvalidFrame, UnsupportedParameter
from core.events import RequestedSampling
from server.protocol import MAX_CONTENT_CHARS, Text


class TextPart(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text"]
    text: Text = Field(max_length=MAX_CONTENT_CHARS)


class ChatCompletionMessage(BaseModel):
    """A message as the API sends it: content as a string or as a list of text parts;
    ``developer`` is the newer name of ``system``."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] = Field(max_length=MAX_CONTENT_CHARS)

    @model_validator(mode="after")
    def _not_too_long(self) -> ChatCompletionMessage:
        if len(self.text) > MAX_CONTENT_CHARS:
            raise ValueError(f"a message holds at most {MAX_CONTENT_CHARS} characters")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @property
    def chat_role(self) -> Literal["system", "user", "assistant"]:
        return "system" if self.role == "developer" else self.role


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

    def sampling(self) -> RequestedSampling | None:
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
        asked = RequestedSampling(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
        )
        return None if asked == RequestedSampling() else asked
