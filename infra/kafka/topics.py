"""Topics are created explicitly with their partition counts; brokers never auto-create them."""

from __future__ import annotations

from dataclasses import dataclass

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from core.errors import ConfigError, LogUnavailable


def dead_letter_topic(topic: str) -> str:
    return f"{topic}.dlq"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication: int


def event_topics(topic: str, partitions: int, replication: int) -> list[TopicSpec]:
    """The event topic and its dead-letter topic (one partition: it is small and ordered)."""
    return [
        TopicSpec(topic, partitions, replication),
        TopicSpec(dead_letter_topic(topic), 1, replication),
    ]


def create_topics(bootstrap: str, specs: list[TopicSpec]) -> list[str]:
    """Create missing topics; returns those created. An existing topic with another partition
    count is a ``ConfigError`` (partitions decide key order and cannot be changed safely)."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=15000)
    except KafkaError as exc:
        raise LogUnavailable(f"Kafka at {bootstrap} is unreachable: {exc}") from exc
    try:
        existing = _partition_counts(admin, [s.name for s in specs])
        created = []
        for spec in specs:
            have = existing.get(spec.name)
            if have is not None:
                if have != spec.partitions:
                    raise ConfigError(
                        f"topic {spec.name} exists with {have} partitions, not {spec.partitions}"
                    )
                continue
            try:
                admin.create_topics(
                    [NewTopic(spec.name, spec.partitions, spec.replication)], timeout_ms=15000
                )
                created.append(spec.name)
            except TopicAlreadyExistsError:
                continue
        return created
    except KafkaError as exc:
        raise LogUnavailable(f"Kafka at {bootstrap}: {exc}") from exc
    finally:
        admin.close()


def _partition_counts(admin: KafkaAdminClient, names: list[str]) -> dict[str, int]:
    present = set(admin.list_topics())
    wanted = [n for n in names if n in present]
    if not wanted:
        return {}
    return {t["name"]: len(t["partitions"]) for t in admin.describe_topics(wanted)}
