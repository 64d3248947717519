"""The one typed settings object. Only the composition root (``macaron``) reads it from the
environment (prefix ``MACARON_``); everything else receives it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from core.experience import FILTER_VERSION, FILTER_VERSIONS


def default_home() -> Path:
    return Path.home() / ".local" / "state" / "macaron"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MACARON_", extra="forbid", frozen=True)

    home: Path = Field(default_factory=default_home, description="State folder: data, logs, PIDs")
    bind_host: str = Field(default="127.0.0.1", description="Address the embedded servers bind")

    database_url: str | None = Field(
        default=None, description="PostgreSQL URL; unset means the embedded server"
    )
    postgres_port: int = Field(default=55432, ge=1, le=65535)

    redis_port: int = Field(default=56379, ge=1, le=65535)

    event_log: Literal["postgres", "kafka"] = "postgres"
    kafka_bootstrap: str | None = Field(
        default=None, description="host:port[,host:port]; unset means the embedded broker"
    )
    kafka_port: int = Field(default=59092, ge=1, le=65535, description="embedded broker port")
    kafka_topic: str = Field(default="macaron.events", pattern=r"^[A-Za-z0-9._-]{1,200}$")
    kafka_partitions: int = Field(default=6, ge=1, le=1024)
    kafka_replication: int = Field(default=1, ge=1, le=16)

    http_port: int = Field(default=8420, ge=1, le=65535, description="`macaron serve` port")
    master_key_file: Path | None = Field(
        default=None,
        description="master keys that wrap tenants' data keys; unset means $MACARON_HOME/"
        "master.key, made on first start",
    )
    model_dir: Path | None = Field(
        default=None, description="base model folder; unset means the pulled SmolLM2-135M"
    )
    engine: Literal["local", "vllm"] = Field(
        default="local",
        description="local: this process runs the model; vllm: the vLLM fleet at vllm_urls",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="the dtype the local engine serves chat in (bfloat16 needs a CPU with "
        "avx512_bf16 or amx_bf16), and so does the server's rollout lane; the contract always runs "
        "float32",
    )
    vllm_urls: str = Field(
        default="", description="comma-separated base URLs of the vLLM replicas (engine=vllm)"
    )
    vllm_max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="the replicas' --max-lora-rank (engine=vllm)"
    )
    max_frame_bytes: int = Field(default=65_536, ge=1024, le=16 * 2**20)
    turns_per_minute: int = Field(default=30, ge=1, le=100_000, description="per API key")
    max_connections_per_tenant: int = Field(default=100, ge=1, le=100_000)
    max_new_tokens: int = Field(default=256, ge=1, le=8192)

    redis_url: str | None = Field(
        default=None,
        description="Celery broker and results, and the servers' shared per-key rate limits; "
        "unset means the embedded Redis (and each server counts its own limits in memory)",
    )
    train_threshold: int = Field(
        default=32, ge=1, le=1_000_000, description="new experience records that start a run"
    )
    router_threshold: int = Field(
        default=50,
        ge=0,
        le=1_000_000,
        description="new routing labels that start a router run (0: no router runs)",
    )
    experience_filter: str = Field(
        default=FILTER_VERSION,
        description="the filter rules new traffic is derived under (past traffic: a backfill)",
    )
    harness_proposals: bool = Field(
        default=True,
        description="after each adapter run is decided, propose a harness successor for its "
        "specialist (grammar, exemplars or prompt), judged by the same contract",
    )
    task_visibility_timeout: int = Field(
        default=900,
        ge=5,
        le=86_400,
        description="seconds before an unacknowledged task is given to another worker",
    )
    training_lease_seconds: int = Field(
        default=120,
        ge=5,
        le=3600,
        description="a training run's lease, renewed while it trains; another worker may take "
        "over a run whose lease ran out (its worker died)",
    )
    contract_path: Path | None = Field(
        default=None, description="unset means contract 2s (learners/contract-v2s.yaml)"
    )
    full_evaluation: bool = Field(
        default=False,
        description="serve a candidate every contract task, not only those its change can "
        "touch (an audit, or the baseline of bench/loop.py)",
    )
    training_config: Path | None = Field(default=None, description="unset means the default")
    task_bank_path: Path | None = Field(
        default=None,
        description="the training task bank (rollout environments, simulated users); unset "
        "means bank v1",
    )

    otel_traces: Literal["off", "console", "otlp"] = Field(
        default="off", description="where spans go: nowhere, stderr, or the OTLP collector"
    )
    otel_endpoint: str = Field(
        default="http://127.0.0.1:4318",
        pattern=r"^https?://",
        description="OTLP/HTTP collector base URL (traces go to /v1/traces)",
    )
    log_format: Literal["json", "text"] = Field(
        default="json", description="server logs: JSON lines with trace ids, or plain text"
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="/metrics port of `streams run` and `worker` (the server uses its own port)",
    )

    @field_validator("experience_filter")
    @classmethod
    def _known_filter(cls, version: str) -> str:
        if version not in FILTER_VERSIONS:
            raise ValueError(f"one of {', '.join(FILTER_VERSIONS)}")
        return version

    @model_validator(mode="after")
    def _fleet(self) -> Settings:
        if self.engine == "vllm" and not self.vllm_replicas:
            raise ValueError("MACARON_ENGINE=vllm needs MACARON_VLLM_URLS (comma-separated)")
        for url in self.vllm_replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"MACARON_VLLM_URLS: {url!r} is not an http(s) URL")
        return self

    @property
    def vllm_replicas(self) -> list[str]:
        return [url.strip() for url in self.vllm_urls.split(",") if url.strip()]

    @property
    def kafka_servers(self) -> str:
        """The Kafka bootstrap servers: the configured ones, or the embedded broker's."""
        return self.kafka_bootstrap or f"{self.bind_host}:{self.kafka_port}"
