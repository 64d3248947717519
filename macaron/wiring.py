"""Build adapters from settings. The only place that decides which adapter serves a port."""

from __future__ import annotations

from core.log import EventLog
from core.settings import Settings
from infra.kafka.eventlog import KafkaEventLog
from infra.local_stack import LocalStack
from infra.postgres.db import Pool, open_pool
from infra.postgres.eventlog import PostgresEventLog


def database_url(settings: Settings) -> str:
    return settings.database_url or LocalStack(settings).postgres.url()


def event_log(settings: Settings, pool: Pool) -> EventLog:
    if settings.event_log == "kafka":
        return KafkaEventLog(settings.kafka_servers, settings.kafka_topic, pool)
    return PostgresEventLog(pool, database_url(settings))


def pool(settings: Settings) -> Pool:
    return open_pool(database_url(settings))
