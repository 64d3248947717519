"""The ``Engine`` port: generate text with the frozen base model and, per request, at most one
LoRA adapter named by its versioned name (``coding@7``). The local engine and the vLLM fleet
implement it."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ADAPTER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}@[0-9]{1,9}")  # use fullmatch
FinishReason = Literal["stop", "length", "cancelled"]


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=8192)
    stop: tuple[str, ...] = Field(default=(), max_length=8)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    ignore_eos: bool = Field(default=False, description="generate max_tokens (benchmarks)")

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value


class OutputConstraint(BaseModel):
    """What a constrained answer must be, enforced token by token while decoding: a JSON value
    valid against ``json_schema`` (``kind="json_schema"``), or any JSON value (``kind="json"``);
    with ``or_text``, plain text instead is allowed too, if it does not begin with ``{`` or
    whitespace (an agent answers in text or calls a tool, and a call is always well-formed).

    A schema must be bounded (``core.harness.grammars.unbounded_paths``); plain ``json`` is
    bounded only by ``max_tokens``, so its answer may be cut at the limit (finish ``length``).
    The answer is written without free whitespace and ends when the value is complete."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_schema", "json"]
    json_schema: dict[str, Any] | None = None
    or_text: bool = False

    @model_validator(mode="after")
    def _schema_for_its_kind(self) -> OutputConstraint:
        if (self.kind == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required for kind json_schema, and only for it")
        return self


class GenerationRequest(BaseModel):
    """``prompt`` is text (tokenised by the engine) or token ids; ``constraint``, when given,
    is enforced at decode time (or the engine refuses it with a typed error before any token)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    prompt: str | tuple[int, ...]
    adapter: str | None = Field(default=None, description="versioned name, or None for the base")
    params: SamplingParams = SamplingParams()
    constraint: OutputConstraint | None = None

    @field_validator("adapter")
    @classmethod
    def _versioned(cls, value: str | None) -> str | None:
        if value is not None and not ADAPTER_NAME.fullmatch(value):
            raise ValueError("adapter must be a versioned name such as coding@3")
        return value


class GenerationChunk(BaseModel):
    """One streamed piece: new text and token ids; the last chunk carries ``finish_reason``."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Engine(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the completion; closing the iterator cancels the request. A constraint the
        engine cannot take is ``GrammarInvalid``, ``GrammarUnbounded`` or
        ``ConstraintUnsupported``, raised before any chunk."""
        ...

    def load_adapter(self, name: str, path: str) -> None:
        """Make ``name`` servable from a PEFT folder; raises typed adapter errors."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``: requests in flight on it finish first."""
        ...

    def loaded_adapters(self) -> list[str]: ...

    def prepare(self, constraint: OutputConstraint) -> None:
        """Check ``constraint`` and make it ready to decode (compiled), so that no request
        waits for it; the typed errors ``generate`` would raise. Seconds: call it off the loop."""
        ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        """Token ids of a conversation in the model's chat template, ready for the reply."""
        ...

    def close(self) -> None:
        """Stop taking requests; those in flight end with ``EngineUnavailable``."""
        ...
