"""The vLLM fleet engine: the ``Engine`` port over N vLLM OpenAI-compatible servers.

Every replica serves the same base model with ``--enable-lora``. An adapter is loaded by its
versioned name (``coding@7``) through ``/v1/load_lora_adapter`` on every healthy replica, and a
one-token canary request on each proves it before the name counts as loaded; a failure on any
replica unloads it from the others. A request goes to the healthy replica with the fewest
requests in flight (ties rotate). When a replica fails before the first token the request is
retried on another; after the first token it ends with a retryable ``EngineUnavailable``.
vLLM's refusals are mapped by HTTP status and error type, never by message text.

A health thread polls each replica's ``/v1/models`` (which also lists its adapters): a replica
that comes back, or lost adapters in a restart, gets the loaded adapters again before it takes
requests. ``unload_adapter`` drains: new requests on the name are refused at once, and the
replicas unload it when its last request ends.

Base-model requests are refused: on vLLM's CPU backend a base-model request batched with LoRA
requests can get a stray adapter applied, so none goes to a LoRA-enabled replica (every release
names an adapter for every specialist, version 0 computing exactly the base model).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from core.engine import ADAPTER_NAME, FinishReason, GenerationChunk, GenerationRequest
from core.errors import (
    AdapterInvalid,
    AdapterNotFound,
    BaseModelNotServed,
    ConfigError,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    MacaronError,
    ModelUnavailable,
)
from infra import observe
from server.engines.local import chat_prompt_ids, prompt_ids
from server.engines.lora import check_rank, read_adapter_config

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
CONNECT_TIMEOUT_S = 2.0
ADMIN_TIMEOUT_S = 120.0  # loading an adapter can take a while on a busy replica
FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}


@dataclass(eq=False)
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    requests: int = 0  # sent to it so far, retries included


class ReplicaLost(Exception):
    """The replica's connection or engine failed, or it lacks an adapter it was given: the
    request may go to another replica."""

    def __init__(self, reason: str, *, adapter_missing: bool = False) -> None:
        super().__init__(reason)
        self.adapter_missing = adapter_missing


def _error_info(body: bytes) -> tuple[str, str]:
    """vLLM's error body ``{"error": {"type", "message"}}`` as (type, message)."""
    try:
        error = json.loads(body)["error"]
        return str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        return "", body[:200].decode(errors="replace")


def _has_choices(body: bytes) -> bool:
    try:
        return bool(json.loads(body)["choices"])
    except (ValueError, KeyError, TypeError):
        return False


def _parse_event(data: str, url: str) -> tuple[str, tuple[int, ...], FinishReason | None]:
    """One server-sent event of a streamed completion: (text, token ids, finish reason)."""
    try:
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            raise refusal(
                int(error.get("code") or 500),
                str(error.get("type")),
                str(error.get("message")),
                url,
            )
        choice = event["choices"][0]
        tokens = tuple(int(t) for t in choice.get("token_ids") or ())
        finish = choice.get("finish_reason")
        return (
            str(choice["text"]),
            tokens,
            None if finish is None else FINISH.get(finish, "cancelled"),
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ReplicaLost(f"a malformed event in the stream ({exc!r})") from exc


def refusal(status: int, kind: str, message: str, url: str) -> Exception:
    """A generation refusal by status and type: what the caller gets, or ``ReplicaLost`` when
    another replica should try."""
    if status == 429:
        return EngineOverloaded(f"vLLM replica {url} is overloaded: {message}")
    if status == 404 or kind == "NotFoundError":
        # An adapter this engine loaded, gone from the replica (a restart, or an unload behind
        # our back): the health check loads it again.
        return ReplicaLost(f"{status} {kind}: {message}", adapter_missing=True)
    if status >= 500:  # its engine failed
        return ReplicaLost(f"{status} {kind}: {message}")
    return EngineError(f"vLLM replica {url} refused the request ({status} {kind}): {message}")


class FleetEngine:
    """``Engine`` over vLLM replicas (base URLs such as ``http://10.0.0.5:8000``)."""

    def __init__(
        self,
        urls: Sequence[str],
        model_dir: Path,
        *,
        max_lora_rank: int = 16,
        max_in_flight: int = 64,
        timeout_s: float = 60.0,
        health_interval_s: float = 2.0,
    ) -> None:
        if not urls:
            raise ConfigError("the vLLM fleet needs at least one replica URL")
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise ModelUnavailable(f"cannot load the tokenizer from {model_dir}: {exc}") from exc
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.max_lora_rank = max_lora_rank
        self.max_in_flight = max_in_flight
        self._timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(timeout=httpx.Timeout(ADMIN_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
        self._adapters: dict[str, str] = {}  # name -> folder, as every replica reads it
        self._in_use: dict[str, int] = {}
        self._retired: set[str] = set()
        self._turn = itertools.count()
        self._lock = threading.Lock()  # counters and health
        self._admin = threading.Lock()  # one load, unload or resynchronisation at a time
        self._stopping = threading.Event()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="macaron-fleet-unload")
        self.check_health()
        self._watcher = threading.Thread(
            target=self._watch, args=(health_interval_s,), name="macaron-fleet", daemon=True
        )
        self._watcher.start()

    # --- health -----------------------------------------------------------------------------

    def check_health(self) -> None:
        """Poll every replica; give one that lacks loaded adapters those adapters first."""
        for replica in self.replicas:
            self._sync(replica)
        self._count_in_service()

    def _sync(self, replica: Replica) -> None:
        """Check one replica and load what it lacks; it is in service only when that works."""
        with self._admin:
            try:
                served = self._served(replica)
                with self._lock:
                    wanted = {n: p for n, p in self._adapters.items() if n not in self._retired}
                for name, path in wanted.items():
                    if name not in served:
                        self._load_on(replica, name, path)
                up = True
            except (ReplicaLost, MacaronError) as exc:
                up = False
                if replica.healthy:
                    log.warning("vLLM replica %s is out of service: %s", replica.url, exc)
            with self._lock:
                if up and not replica.healthy:
                    log.info("vLLM replica %s is in service", replica.url)
                replica.healthy = up

    def _count_in_service(self) -> None:
        observe.replicas_in_service.set(sum(r.healthy for r in self.replicas))

    def _watch(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            try:
                self.check_health()
            except Exception:  # last resort: the health thread must outlive any one answer
                log.exception("vLLM fleet health check failed; trying again")

    def _mark_down(self, replica: Replica, reason: object) -> None:
        with self._lock:
            if replica.healthy:
                log.warning("vLLM replica %s failed a request: %s", replica.url, reason)
            replica.healthy = False
        self._count_in_service()

    # --- adapters ---------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Load on every healthy replica and canary each; all or nothing."""
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterInvalid(f"{name!r} is not a versioned adapter name such as coding@3")
        with self._lock:
            if name in self._adapters and name not in self._retired:
                return  # versioned names are immutable: loaded once is loaded
        # vLLM answers a rank above --max-lora-rank with a bare 500, so check it here.
        check_rank(name, read_adapter_config(Path(path)), self.max_lora_rank)
        with self._admin:
            with self._lock:
                ready = [r for r in self.replicas if r.healthy]
            if not ready:
                raise EngineUnavailable(self._none_ready())
            done: list[Replica] = []
            try:
                for replica in ready:
                    if name not in self._served(replica):
                        self._load_on(replica, name, path)
                        done.append(replica)
                    self._canary(replica, name)
            except (ReplicaLost, MacaronError) as exc:
                for replica in done:
                    self._unload_on(replica, name)
                if isinstance(exc, MacaronError):
                    raise
                raise EngineUnavailable(f"loading {name}: {exc}") from exc
            with self._lock:
                self._adapters[name] = path
                self._retired.discard(name)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters or name in self._retired:
                raise AdapterNotFound(f"adapter {name} is not loaded")
            if self._in_use.get(name):
                self._retired.add(name)  # unloaded when its last request ends
                return
            del self._adapters[name]
        self._unload_later(name)

    def loaded_adapters(self) -> list[str]:
        with self._lock:
            return [n for n in self._adapters if n not in self._retired]

    def _unload_later(self, name: str) -> None:
        """Unload from every replica on the admin thread: callers may be on an event loop."""

        def unload() -> None:
            with self._admin:
                with self._lock:
                    if name in self._adapters:
                        return  # loaded again since: the replicas keep it
                for replica in self.replicas:
                    self._unload_on(replica, name)

        if not self._stopping.is_set():
            with contextlib.suppress(RuntimeError):  # closing meanwhile: nothing to tidy
                self._background.submit(unload)

    def _resync_later(self, replica: Replica) -> None:
        if not self._stopping.is_set():
            with contextlib.suppress(RuntimeError):
                self._background.submit(self._sync, replica)

    def _served(self, replica: Replica) -> set[str]:
        """Model names the replica serves (its base model and loaded adapters)."""
        try:
            response = self._http.get(f"{replica.url}/v1/models", timeout=CONNECT_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable ({exc.__class__.__name__})") from exc
        if response.status_code != 200:
            raise ReplicaLost(f"/v1/models answered {response.status_code}")
        try:
            return {str(model["id"]) for model in response.json()["data"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise ReplicaLost(f"/v1/models answered what is not a model list ({exc!r})") from exc

    def _load_on(self, replica: Replica, name: str, path: str) -> None:
        try:
            response = self._http.post(
                f"{replica.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
            )
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable while loading {name}") from exc
        if response.status_code == 200:
            return
        kind, message = _error_info(response.content)
        if response.status_code == 400 and name in self._served(replica):
            return  # another server sharing the fleet loaded it meanwhile
        if response.status_code == 404 or kind == "NotFoundError":
            raise AdapterInvalid(
                f"vLLM replica {replica.url} finds no adapter files at {path} "
                "(the replicas must see the adapter store at the same path)"
            )
        raise AdapterInvalid(
            f"vLLM replica {replica.url} refused adapter {name} "
            f"({response.status_code} {kind}): {message}"
        )

    def _unload_on(self, replica: Replica, name: str) -> None:
        """Best effort: a replica that is away has lost its adapters anyway."""
        try:
            response = self._http.post(
                f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}
            )
        except httpx.TransportError:
            return
        if response.status_code not in (200, 404):
            kind, message = _error_info(response.content)
            log.warning(
                "vLLM replica %s did not unload %s (%s %s): %s",
                replica.url,
                name,
                response.status_code,
                kind,
                message,
            )

    def _canary(self, replica: Replica, name: str) -> None:
        prompt = self.chat_prompt([{"role": "user", "content": "Say hello."}])
        body = {"model": name, "prompt": list(prompt), "max_tokens": 1, "temperature": 0.0}
        try:
            response = self._http.post(f"{replica.url}/v1/completions", json=body)
        except httpx.TransportError as exc:
            raise ReplicaLost(f"unreachable during the canary request on {name}") from exc
        if response.status_code != 200 or not _has_choices(response.content):
            kind, message = _error_info(response.content)
            raise EngineError(
                f"canary request on {name} failed on vLLM replica {replica.url} "
                f"({response.status_code} {kind}): {message}"
            )

    def _acquire(self, name: str) -> None:
        with self._lock:
            if name not in self._adapters or name in self._retired:
                raise AdapterNotFound(f"adapter {name} is not loaded")
            self._in_use[name] = self._in_use.get(name, 0) + 1

    def _release(self, name: str) -> None:
        with self._lock:
            self._in_use[name] -= 1
            if self._in_use[name]:
                return
            del self._in_use[name]
            if name not in self._retired:
                return
            self._retired.discard(name)
            del self._adapters[name]
        self._unload_later(name)

    # --- requests ---------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return chat_prompt_ids(self.tokenizer, messages)

    def _none_ready(self) -> str:
        urls = ", ".join(r.url for r in self.replicas)
        return f"no vLLM replica is in service ({urls}); retry shortly"

    def _pick(self, tried: set[Replica]) -> Replica:
        """The healthy replica with the fewest requests in flight, counted in."""
        with self._lock:
            ready = [r for r in self.replicas if r.healthy and r not in tried]
            if not ready:
                raise EngineUnavailable(self._none_ready())
            start = next(self._turn) % len(ready)
            best = min(ready[start:] + ready[:start], key=lambda r: r.in_flight)
            if best.in_flight >= self.max_in_flight:
                raise EngineOverloaded(
                    f"every vLLM replica has {self.max_in_flight} requests in flight; retry shortly"
                )
            best.in_flight += 1
            best.requests += 1
            return best

    def _done(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.adapter is None:
            raise BaseModelNotServed(
                "the vLLM fleet serves adapters only (a base-model request on a LoRA-enabled "
                "vLLM replica can get a stray adapter); name one, such as chat@0"
            )
        prompt = (
            list(request.prompt)
            if isinstance(request.prompt, tuple)
            else prompt_ids(self.tokenizer, request.prompt)
        )
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if self._stopping.is_set():
            raise EngineUnavailable("the engine was shut down")
        self._acquire(request.adapter)
        try:
            tried: set[Replica] = set()
            missing = 0  # replicas that answered "no such adapter"
            while True:
                try:
                    replica = self._pick(tried)
                except EngineUnavailable:
                    if tried and missing == len(tried):
                        raise AdapterNotFound(
                            f"adapter {request.adapter} is on no vLLM replica; the health "
                            "check is loading it again"
                        ) from None
                    raise
                tried.add(replica)
                streamed = False
                try:
                    stream = self._stream(replica, request, prompt)
                    async with contextlib.aclosing(stream) as chunks:
                        async for chunk in chunks:
                            streamed = True
                            yield chunk
                    return
                except ReplicaLost as exc:
                    if exc.adapter_missing:  # the replica is fine; give it its adapters back
                        missing += 1
                        self._resync_later(replica)
                    else:
                        self._mark_down(replica, exc)
                    if streamed:
                        raise EngineUnavailable(
                            f"vLLM replica {replica.url} was lost mid-answer; retry the turn"
                        ) from None
                    observe.replica_failovers.add(1)
                finally:
                    self._done(replica)
        finally:
            self._release(request.adapter)

    async def _stream(
        self, replica: Replica, request: GenerationRequest, prompt: list[int]
    ) -> AsyncGenerator[GenerationChunk, None]:
        params = request.params
        body: dict[str, Any] = {
            "model": request.adapter,
            "prompt": prompt,
            "stream": True,
            "return_token_ids": True,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "ignore_eos": params.ignore_eos,
            "stop": list(params.stop),
        }
        if params.seed is not None:
            body["seed"] = params.seed
        completion = 0
        try:
            async with (
                httpx.AsyncClient(timeout=self._timeout) as client,
                client.stream("POST", f"{replica.url}/v1/completions", json=body) as response,
            ):
                if response.status_code != 200:
                    kind, message = _error_info(await response.aread())
                    raise refusal(response.status_code, kind, message, replica.url)
                async for line in response.aiter_lines():
                    if self._stopping.is_set():
                        raise EngineUnavailable("the engine was shut down")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    text, tokens, finish = _parse_event(line[len("data: ") :], replica.url)
                    completion += len(tokens)
                    yield GenerationChunk(
                        request_id=request.request_id,
                        text=text,
                        token_ids=tokens,
                        finish_reason=finish,
                        prompt_tokens=len(prompt),
                        completion_tokens=completion,
                    )
                    if finish is not None:
                        return
        except httpx.HTTPError as exc:  # refused, reset, timed out, cut short, undecodable
            raise ReplicaLost(f"{exc.__class__.__name__}: {exc}") from exc
        raise ReplicaLost("the stream ended without a finish reason")

    def close(self) -> None:
        """Stop polling; requests still streaming end with ``EngineUnavailable``."""
        self._stopping.set()
        self._watcher.join(timeout=ADMIN_TIMEOUT_S)  # a health check may be loading adapters
        self._background.shutdown(wait=True)  # unloads already asked for go out first
        self._http.close()
