"""The ``Engine`` port: generate text with the frozen base model and, per request, at most one
LoRA adapter named by its versioned name (``coding@7``). The local engine and the vLLM fleet
implement it."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

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


class GenerationRequest(BaseModel):
    """``prompt`` is text (tokenised by the engine) or token ids."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    prompt: str | tuple[int, ...]
    adapter: str | None = Field(default=None, description="versioned name, or None for the base")
    params: SamplingParams = SamplingParams()

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
        """Stream the completion; closing the iterator cancels the request."""
        ...

    def load_adapter(self, name: str, path: str) -> None:
        """Make ``name`` servable from a PEFT folder; raises typed adapter errors."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``: requests in flight on it finish first."""
        ...

    def loaded_adapters(self) -> list[str]: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        """Token ids of a conversation in the model's chat template, ready for the reply."""
        ...

    def close(self) -> None:
        """Stop taking requests; those in flight end with ``EngineUnavailable``."""
        ...
