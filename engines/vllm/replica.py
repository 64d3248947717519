"""One vLLM replica: its place in the balancer (health, requests in flight) and the
administrative HTTP calls the fleet makes to it (list, load, unload, canary)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import httpx

from core.engine import GenerationRequest
from core.errors import AdapterInvalid, ContextLengthExceeded, EngineError
from engines.vllm.errors import ReplicaLost, error_info

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0
ADMIN_TIMEOUT_S = 120.0  # loading an adapter can take a while on a busy replica


def admin_client() -> httpx.Client:
    """The client for administrative calls, shared by every replica of a fleet."""
    return httpx.Client(timeout=httpx.Timeout(ADMIN_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))


def _has_choices(body: bytes) -> bool:
    try:
        return bool(json.loads(body)["choices"])
    except (ValueError, KeyError, TypeError):
        return False


def fitted(
    replicas: list[Replica], request: GenerationRequest, prompt_tokens: int
) -> GenerationRequest:
    """``request`` with its answer capped to the room the shortest ``max_model_len`` among the
    replicas leaves after the prompt, as the local engine ends an answer there; a prompt that
    leaves no room is ``ContextLengthExceeded`` (vLLM's own refusal would reach the user as
    ``engine_error``)."""
    lengths = [r.max_model_len for r in replicas if r.max_model_len is not None]
    if not lengths:
        return request
    room = min(lengths) - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"the context is {prompt_tokens} tokens; this model takes at most "
            f"{min(lengths) - 1}: send a shorter message or fewer earlier ones"
        )
    if request.params.max_tokens <= room:
        return request
    return request.model_copy(
        update={"params": request.params.model_copy(update={"max_tokens": room})}
    )


@dataclass(eq=False)
class Replica:
    """A vLLM server at ``url`` (such as ``http://10.0.0.5:8000``), reached through ``http``."""

    url: str
    http: httpx.Client = field(repr=False)
    healthy: bool = False
    in_flight: int = 0
    requests: int = 0  # sent to it so far, retries included
    max_model_len: int | None = None  # prompt and answer, in tokens (from /v1/models)

    def served(self) -> set[str]:
        """Model names the replica serves (its base model and loaded adapters); notes the
        context length it takes."""
        try:
            response = self.http.get(f"{self.url}/v1/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable ({exc.__class__.__name__})") from exc
        if response.status_code != 200:
            raise ReplicaLost(f"/v1/models answered {response.status_code}")
        try:
            models = response.json()["data"]
            lengths = [
                m["max_model_len"] for m in models if isinstance(m.get("max_model_len"), int)
            ]
            self.max_model_len = min(lengths, default=None)
            return {str(model["id"]) for model in models}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ReplicaLost(f"/v1/models answered what is not a model list ({exc!r})") from exc

    def load(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` (a folder as the replica sees it)."""
        try:
            response = self.http.post(
                f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
            )
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable while loading {name}") from exc
        if response.status_code == 200:
            return
        kind, message = error_info(response.content)
        if response.status_code == 400 and name in self.served():
            return  # another server sharing the fleet loaded it meanwhile
        if response.status_code == 404 or kind == "NotFoundError":
            raise AdapterInvalid(
                f"vLLM replica {self.url} finds no adapter files at {path} "
                "(the replicas must see the adapter store at the same path)"
            )
        raise AdapterInvalid(
            f"vLLM replica {self.url} refused adapter {name} "
            f"({response.status_code} {kind}): {message}"
        )

    def unload(self, name: str) -> None:
        """Best effort: a replica that is away has lost its adapters anyway."""
        try:
            response = self.http.post(
                f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name}
            )
        except httpx.TransportError:
            return
        if response.status_code not in (200, 404):
            kind, message = error_info(response.content)
            log.warning(
                "vLLM replica %s did not unload %s (%s %s): %s",
                self.url,
                name,
                response.status_code,
                kind,
                message,
            )

    def canary(self, name: str, prompt: tuple[int, ...]) -> None:
        """Prove adapter ``name`` answers: one greedy token of ``prompt``."""
        body = {"model": name, "prompt": list(prompt), "max_tokens": 1, "temperature": 0.0}
        try:
            response = self.http.post(f"{self.url}/v1/completions", json=body)
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable during the canary request on {name}") from exc
        if response.status_code != 200 or not _has_choices(response.content):
            kind, message = error_info(response.content)
            raise EngineError(
                f"canary request on {name} failed on vLLM replica {self.url} "
                f"({response.status_code} {kind}): {message}"
            )
