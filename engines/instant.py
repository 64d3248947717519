"""``InstantEngine``: answers without a model, instantly. For benchmarks and tests of the server
and the harness only (``bench/ws.py`` measures the server and the log alone with it); never
wired into ``macaron serve``.

Its "tokens" are the UTF-8 bytes of the chat messages, so ``script`` sees exactly the context
the harness built and decides the answer, which is streamed word by word.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

from core.engine import GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import AdapterNotFound, ConstraintUnsupported

Script = Callable[[list[dict[str, str]]], str]


def fixed_reply(text: str) -> Script:
    return lambda _messages: text


class InstantEngine:
    def __init__(self, script: Script) -> None:
        self.script = script
        self._adapters: dict[str, str] = {}

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return tuple(json.dumps(messages).encode())

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.adapter is not None and request.adapter not in self._adapters:
            raise AdapterNotFound(f"adapter {request.adapter} is not loaded")
        if request.constraint is not None:  # never an unconstrained answer in its place
            raise ConstraintUnsupported("the instant engine's answers come from its script")
        if not isinstance(request.prompt, tuple):
            raise ValueError("the instant engine takes prompts from its own chat_prompt")
        messages = json.loads(bytes(request.prompt).decode())
        words = self.script(messages).split(" ")[: request.params.max_tokens]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            yield GenerationChunk(
                request_id=request.request_id,
                text=word if i == 0 else " " + word,
                token_ids=(i,),
                finish_reason="stop" if last else None,
                prompt_tokens=len(request.prompt),
                completion_tokens=i + 1,
            )
            await asyncio.sleep(0)

    def load_adapter(self, name: str, path: str) -> None:
        self._adapters[name] = path

    def prepare(self, constraint: OutputConstraint) -> None:
        raise ConstraintUnsupported("the instant engine's answers come from its script")

    def unload_adapter(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise AdapterNotFound(f"adapter {name} is not loaded")

    def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    def close(self) -> None:
        self._adapters.clear()
