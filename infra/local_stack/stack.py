"""The embedded servers of one ``MACARON_HOME``, started, stopped and checked together."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import StackError
from core.settings import Settings
from infra.local_stack.postgres import EmbeddedPostgres
from infra.local_stack.tansu import EmbeddedKafka
from infra.local_stack.valkey import EmbeddedRedis


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    address: str
    pid: int | None
    healthy: bool
    detail: str


class LocalStack:
    """The embedded servers for one ``MACARON_HOME``."""

    def __init__(self, settings: Settings) -> None:
        home = settings.home.expanduser().resolve()
        self.home = home
        self.postgres = EmbeddedPostgres(home, settings.bind_host, settings.postgres_port)
        self.redis = EmbeddedRedis(home, settings.bind_host, settings.redis_port)
        self.kafka = EmbeddedKafka(home, settings.bind_host, settings.kafka_port)

    def up(self, *, kafka: bool = False) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.postgres.start()
        self.redis.start()
        if kafka:
            self.kafka.start()

    def down(self) -> list[str]:
        """Stop every running part (Kafka first, PostgreSQL last); returns what was stopped."""
        stopped, failures = [], []
        for part in (self.kafka, self.redis, self.postgres):
            try:
                if part.stop():
                    stopped.append(part.name)
            except StackError as exc:  # keep stopping the others
                failures.append(exc.message)
        if failures:
            raise StackError("; ".join(failures))
        return stopped

    def status(self) -> list[ComponentStatus]:
        rows = []
        for part in (self.postgres, self.redis, self.kafka):
            if part.running():
                healthy, detail = part.health()
            else:
                healthy, detail = False, "stopped"
            rows.append(ComponentStatus(part.name, part.address, part.pid(), healthy, detail))
        return rows
