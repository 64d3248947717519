"""What every embedded server shares: a detached process started in its own session, known by
the PID in its PID file, stopped by that PID; and the port and PID checks around it."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import time
from abc import ABC, abstractmethod
from pathlib import Path

from core.errors import StackError

START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0


# Ports handed to servers are drawn below Linux's ephemeral range (32768-60999 by default), so
# the local end of an outgoing connection cannot take one between the draw and the server's bind.
SERVER_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at this moment and that this process has
    not handed out before (for tests and benches)."""
    for _ in range(1000):
        port = SERVER_PORTS[secrets.randbelow(len(SERVER_PORTS))]
        if port not in _handed_out and port_free("127.0.0.1", port):
            _handed_out.add(port)
            return port
    raise StackError(f"no free port on 127.0.0.1 in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1}")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
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


def pid_runs(pid: int, binary: Path) -> bool:
    """The PID is alive and executes ``binary`` itself: not a reused PID of another process,
    nor the same kind of server started from another installation."""
    if not pid_alive(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.removesuffix(" (deleted)") == str(binary.resolve())


def wait_stopped(pid: int, name: str) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT
    while pid_alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise StackError(f"{name} (pid {pid}) did not stop in {STOP_TIMEOUT:.0f}s; killed")
        time.sleep(0.05)
        reap(pid)


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def secret(path: Path) -> str:
    """Read a generated secret, making it (mode 600) the first time."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


class DetachedServer(ABC):
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
        return pid is not None and pid_runs(pid, self.binary())

    def check_stale(self) -> None:
        pid = self.pid()
        if self.pid_file.exists() and (pid is None or not pid_runs(pid, self.binary())):
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
        return port_open(self.host, self.port)

    def start(self) -> None:
        if self.running():
            return
        self.check_stale()
        if not port_free(self.host, self.port):
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
                    f"last lines of {self.log_file}:\n{tail(self.log_file)}"
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
        was_running = pid is not None and pid_runs(pid, self.binary())
        if was_running and pid is not None:
            os.kill(pid, signal.SIGTERM)
            wait_stopped(pid, self.name)
        self.pid_file.unlink(missing_ok=True)
        return was_running
