"""A test tool: private PostgreSQL and RabbitMQ servers on loopback, for tests and benchmarks
(plain Python, no pytest); nothing is shared with a system installation.

It needs the PostgreSQL 15 server binaries (``OUTBOX_INBOX_PG_BIN_DIR``, default
``/usr/lib/postgresql/15/bin``) and RabbitMQ's scripts (``OUTBOX_INBOX_RABBITMQ_SBIN_DIR``,
default ``/usr/lib/rabbitmq/bin``), as Debian's ``postgresql-15`` and ``rabbitmq-server``
install them. ``start()`` raises :class:`ServerError` naming a missing binary, or with the tail
of the log of a server that does not come up (everything it started killed and removed).

Example::

    from outbox_inbox import Service
    from outbox_inbox.testing.servers import PostgresServer, RabbitMQServer

    with PostgresServer() as pg, RabbitMQServer() as mq:
        pg.create_database("app")
        service = Service("app", db_url=pg.url("app"), mq_url=mq.url)

On both local servers ``stop()`` / ``start()`` keep the data, the name and the ports (durable
queues and persistent messages survive), and ``kill()`` (SIGKILL) simulates a crash.
:class:`ExternalPostgres` / :class:`ExternalRabbitMQ` wrap servers someone else runs: the same
interface, without restarts. Every process started here is killed by ``cleanup()``, by an
``atexit`` hook, or by a watchdog process should the Python process die without either.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import string
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable
from urllib.parse import quote

import pika
import pika.exceptions
import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

# Its log filters put pika's lines about a refused connection (a broker booting) at DEBUG.
from ..brokers import rabbitmq as _rabbitmq  # noqa: F401

__all__ = [
    "PG_BIN_DIR", "RABBITMQ_SBIN_DIR", "ExternalPostgres", "ExternalRabbitMQ", "PostgresHandle",
    "PostgresServer", "RabbitMQHandle", "RabbitMQServer", "ServerError", "free_port",
]  # fmt: skip

log = logging.getLogger("outbox_inbox.testing.servers")

PG_BIN_DIR = Path(os.environ.get("OUTBOX_INBOX_PG_BIN_DIR", "/usr/lib/postgresql/15/bin"))
RABBITMQ_SBIN_DIR = Path(os.environ.get("OUTBOX_INBOX_RABBITMQ_SBIN_DIR", "/usr/lib/rabbitmq/bin"))
LOCALHOST = "127.0.0.1"

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}$")


class ServerError(RuntimeError):
    """A server could not be installed, started, stopped or talked to."""


_handed_out_ports: set[int] = set()
_ports_lock = threading.Lock()


#: Where `free_port` looks below the kernel's ephemeral range (the ports of outgoing
#: connections): from here up to that range's first port.
_LOWEST_PORT = 10000


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port free on ``host`` now, never handed out by this process, below the kernel's
    ephemeral range (why: docs/testing.md, "Private servers for tests")."""
    try:  # the kernel's first port for outgoing connections; off Linux, its default
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    with _ports_lock:
        if low - _LOWEST_PORT >= 1000:
            for _ in range(200):
                port = secrets.randbelow(low - _LOWEST_PORT) + _LOWEST_PORT
                if port in _handed_out_ports:
                    continue
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    try:
                        sock.bind((host, port))
                    except OSError:
                        continue
                _handed_out_ports.add(port)
                return port
        for _ in range(100):  # no room below the ephemeral range: let the kernel choose
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out_ports:
                _handed_out_ports.add(port)
                return port
    raise ServerError("could not find a free TCP port")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state, ppid, ...; [] if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    # "pid (comm) state ppid ..." and comm may contain spaces and parentheses.
    return raw[raw.rfind(")") + 2 :].split()


def _children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    entries = (e.name for e in Path("/proc").iterdir() if e.name.isdigit())
    return [int(name) for name in entries if _stat(name)[1:2] == [str(pid)]]


def wait_until(
    condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1
) -> Any:
    """Call `condition` until it returns something truthy, and return that; AssertionError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return value


def _pid_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs: it does not exist or is a zombie waiting to be reaped."""
    return _stat(pid)[:1] in ([], ["Z"])


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _world_traversable(path: Path) -> bool:
    """True when every directory from / down to ``path`` may be entered by any user."""
    path = path.resolve()
    try:
        return all(os.stat(part).st_mode & stat.S_IXOTH for part in [path, *path.parents])
    except OSError:
        return False


def _run(
    args: list[str], what: str = "", *, timeout: float = 60, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run `args` (stdin from `input` or nothing), output captured as text. With `what`, a
    failure raises ServerError naming it, with the output."""
    kwargs.setdefault("stdin", None if "input" in kwargs else subprocess.DEVNULL)
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    if what and result.returncode != 0:
        raise ServerError(f"{what} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


def _is_root() -> bool:
    return os.geteuid() == 0


def _check_name(name: str, what: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"bad {what} name {name!r}: use letters, digits, '_', '.', '-'")
    return name


_WATCHDOG_SCRIPT = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups, dirs = set(), set()
for line in sys.stdin:
    cmd, _, arg = line.rstrip("\n").partition(" ")
    if cmd == "add":
        groups.add(int(arg))
    elif cmd == "remove":
        groups.discard(int(arg))
    elif cmd == "add-dir":
        dirs.add(arg)
    elif cmd == "remove-dir":
        dirs.discard(arg)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
if dirs:
    time.sleep(1.0)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""


class _Watchdog:
    """One helper process per Python process. It reads ``add PGID`` / ``remove PGID`` and
    ``add-dir PATH`` / ``remove-dir PATH`` lines, and when its stdin reaches EOF (we exited or
    died) it SIGKILLs the process groups and removes the directories still registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner_pid = 0

    def send(self, command: str, arg: object) -> None:
        with self._lock:
            if self._proc is None or self._owner_pid != os.getpid():
                try:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-c", _WATCHDOG_SCRIPT],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                    self._owner_pid = os.getpid()
                except OSError as exc:  # pragma: no cover - best effort only
                    log.warning("could not start the process watchdog: %s", exc)
                    return
            stdin = self._proc.stdin
            assert stdin is not None  # stdin=PIPE
            with contextlib.suppress(OSError, ValueError):
                stdin.write(f"{command} {arg}\n".encode())
                stdin.flush()


_watchdog = _Watchdog()


class _Process:
    """A child process in its own process group, logging to a file, watched by the watchdog."""

    def __init__(
        self,
        args: list[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.args = args
        self.log_path = log_path
        with open(log_path, "ab") as log_file:
            log_file.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
            log_file.flush()
            self.popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.pgid = self.popen.pid  # start_new_session: the child leads its own group
        _watchdog.send("add", self.pgid)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def send_signal(self, sig: signal.Signals) -> None:
        if self.alive:
            _signal_pid(self.pid, sig)

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def wait(self, timeout: float | None) -> bool:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the whole group and reap the leader."""
        self.signal_group(signal.SIGKILL)
        self.wait(30)
        _watchdog.send("remove", self.pgid)

    def finished(self) -> None:
        """The leader exited by itself: make sure nothing of its group stays behind."""
        self.wait(30)
        self.signal_group(signal.SIGKILL)
        _watchdog.send("remove", self.pgid)


_live_servers: weakref.WeakSet[_LocalServer] = weakref.WeakSet()


@atexit.register
def _cleanup_live_servers() -> None:
    for server in list(_live_servers):
        with contextlib.suppress(Exception):
            server.cleanup()


@runtime_checkable
class PostgresHandle(Protocol):
    """What the fixtures need from a PostgreSQL server, local or external."""

    def url(self, dbname: str = ...) -> str: ...

    def connect(self, dbname: str = ..., *, autocommit: bool = ...) -> psycopg.Connection[Any]: ...

    def create_database(self, name: str) -> None: ...

    def drop_database(self, name: str) -> None: ...

    def cleanup(self) -> None: ...


@runtime_checkable
class RabbitMQHandle(Protocol):
    """What the fixtures need from a RabbitMQ server, local or external."""

    supports_vhosts: bool

    @property
    def url(self) -> str: ...

    def url_for_vhost(self, vhost: str) -> str: ...

    def cleanup(self) -> None: ...


class _LocalServer(ABC):
    """A server started here: its files in one temporary directory, made by the first `start`
    and removed by `cleanup`, and one main process (`_proc`) listening on `port`."""

    host = LOCALHOST
    #: The server's name in log lines.
    _kind = ""
    port: int
    startup_timeout: float
    temp_dir: Path | None = None
    _proc: _Process | None = None

    def _require_temp_dir(self) -> Path:
        if self.temp_dir is None:
            raise ServerError(f"{type(self).__name__} was not started")
        return self.temp_dir

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive

    @abstractmethod
    def _make_temp_dir(self) -> Path: ...

    @abstractmethod
    def _launch(self) -> _Process:
        """Start the server's processes (the temporary directory exists); return the main one."""

    #: What `_answers` may raise while the server boots.
    _probe_errors: tuple[type[Exception], ...] = ()

    def _answers(self) -> bool:
        """True once the server answers (`_wait_ready` polls it)."""
        raise NotImplementedError

    def _failure(self, message: str) -> ServerError:
        """A ServerError saying `message` and the tail of the server's log."""
        return ServerError(message)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if not self._proc.alive:
                code = self._proc.popen.returncode
                raise self._failure(f"{self._kind} exited with code {code} while starting")
            try:
                if self._answers():
                    return
            except self._probe_errors as exc:
                last_error = exc
            time.sleep(0.05)
        raise self._failure(
            f"{self._kind} did not answer on port {self.port} within {self.startup_timeout}s "
            f"(last error: {last_error!r})"
        )

    @abstractmethod
    def _kill_processes(self) -> None:
        """SIGKILL every process this object started."""

    def _shut_down(self, proc: _Process, timeout: float) -> bool:
        """Ask the server to stop and wait; False when it took too long and was killed."""
        raise NotImplementedError

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the server gracefully (`_shut_down`), keeping its files for a later `start`."""
        proc = self._proc
        if proc is None:
            return
        started = time.monotonic()
        if not self._shut_down(proc, timeout):
            return
        proc.finished()
        self._proc = None
        log.info(
            "%s on port %s stopped in %.2fs", self._kind, self.port, time.monotonic() - started
        )

    def start(self) -> None:
        """Start the server (the first time: in a fresh temporary directory) and wait until it
        answers. Idempotent while running. Raises :class:`ServerError` with the tail of its log,
        after killing what it started."""
        if self.running:
            return
        started = time.monotonic()
        try:
            if self.temp_dir is None:
                self.temp_dir = self._make_temp_dir()
                _watchdog.send("add-dir", self.temp_dir)
                _live_servers.add(self)
            self._proc = self._launch()
            self._wait_ready()
        except BaseException:
            self._kill_processes()
            raise
        log.info("%s on port %s ready in %.2fs", self._kind, self.port, time.monotonic() - started)

    def cleanup(self) -> None:
        """Stop the server, kill what is left of it and remove its temporary directory."""
        try:
            self.stop(timeout=30)
        finally:
            self._kill_processes()
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                _watchdog.send("remove-dir", self.temp_dir)
                self.temp_dir = None
            _live_servers.discard(self)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()


class _External:
    """A server someone else runs: it cannot be stopped or restarted from here; `cleanup` calls
    ``on_cleanup`` (say, stopping its container) once."""

    def __init__(self, on_cleanup: Callable[[], None] | None) -> None:
        self._on_cleanup = on_cleanup

    def cleanup(self) -> None:
        if self._on_cleanup is not None:
            callback, self._on_cleanup = self._on_cleanup, None
            callback()


class _Databases:
    """CREATE / DROP DATABASE on the server `connect()` reaches (autocommit), the name quoted as
    an identifier: the one way the tests make and remove databases."""

    def connect(
        self, dbname: str = "postgres", *, autocommit: bool = True
    ) -> psycopg.Connection[Any]:
        raise NotImplementedError

    def create_database(self, name: str) -> None:
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str) -> None:
        with self.connect() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


class PostgresServer(_LocalServer, _Databases):
    """A private PostgreSQL 15 server on 127.0.0.1 for tests and benchmarks: ``initdb`` and
    ``postgres`` in a fresh temporary directory (as the ``postgres`` user when we are root)."""

    _kind = "PostgreSQL"
    user = "postgres"

    def __init__(
        self,
        *,
        bin_dir: Path | str = PG_BIN_DIR,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
        base_dir: Path | str | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.bin_dir = Path(bin_dir)
        self.port = port or free_port()
        self.settings: dict[str, str] = {
            "listen_addresses": f"'{LOCALHOST}'",
            "max_connections": "200",
            "shared_buffers": "128MB",
            "fsync": "on",
            "log_min_messages": "warning",
            "log_line_prefix": "'%m [%p] %q%u@%d '",
        }
        self.settings.update(settings or {})
        self.startup_timeout = startup_timeout
        self._base_dir = Path(base_dir) if base_dir is not None else None

    @property
    def data_dir(self) -> Path:
        return self._require_temp_dir() / "data"

    @property
    def socket_dir(self) -> Path:
        return self._require_temp_dir()

    @property
    def log_path(self) -> Path:
        return self._require_temp_dir() / "postgres.log"

    @property
    def pids(self) -> frozenset[int]:
        """Process ids of the processes this object started (the postmaster; its backends are
        its children), e.g. to measure the server's CPU time. Empty while stopped."""
        return frozenset({self._proc.pid} if self._proc is not None else ())

    def _as_postgres(self, args: list[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--", *args] if _is_root() else args

    def _make_temp_dir(self) -> Path:
        base = self._base_dir
        if base is None and _is_root() and not _world_traversable(Path(tempfile.gettempdir())):
            # the postgres user must be able to reach its data directory
            base = Path("/tmp")  # noqa: S108
        temp_dir = Path(tempfile.mkdtemp(prefix="oi-pg-", dir=base))
        if _is_root():
            try:
                pw = pwd.getpwnam(self.user)
            except KeyError:
                shutil.rmtree(temp_dir, ignore_errors=True)
                raise ServerError(
                    "running as root but there is no 'postgres' user to run PostgreSQL as "
                    "(install Debian's postgresql-15 package)"
                ) from None
            os.chown(temp_dir, pw.pw_uid, pw.pw_gid)
        temp_dir.chmod(0o700)
        return temp_dir

    def _initdb(self) -> None:
        assert self.temp_dir is not None
        initdb = self.bin_dir / "initdb"
        if not initdb.exists():
            raise ServerError(f"{initdb} not found: install Debian's postgresql-15 package")
        args = [str(initdb), "-D", str(self.data_dir), "-U", self.user, "--auth=trust"]
        # --no-sync: only an OS crash could lose it; we test process crashes
        args += ["--encoding=UTF8", "--no-locale", "--no-sync", "--no-instructions"]
        _run(self._as_postgres(args), "initdb", cwd=self.temp_dir, timeout=120)
        self._write_settings()

    def _write_settings(self) -> None:
        """Append `settings`, the port and the socket directory to ``postgresql.conf``."""
        settings = dict(self.settings)
        settings["port"] = str(self.port)
        socket_path = f"{self.socket_dir}/.s.PGSQL.{self.port}"
        # Unix socket paths are limited to 107 bytes; tests connect over TCP anyway.
        socket_dir = str(self.socket_dir) if len(socket_path.encode()) < 100 else ""
        settings["unix_socket_directories"] = f"'{socket_dir}'"
        lines = [f"{key} = {value}" for key, value in settings.items()]
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write("\n# written by outbox_inbox.testing.servers\n" + "\n".join(lines) + "\n")

    def _launch(self) -> _Process:
        """The cluster is created on first use (``initdb``), then ``postgres`` started."""
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        return _Process(
            self._as_postgres([str(self.bin_dir / "postgres"), "-D", str(self.data_dir)]),
            log_path=self.log_path,
            cwd=self.temp_dir,
        )

    _probe_errors = (psycopg.OperationalError,)

    def _answers(self) -> bool:
        with psycopg.connect(self.conninfo("postgres"), connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True

    def _failure(self, message: str) -> ServerError:
        return ServerError(f"{message}; log {self.log_path}:\n{_tail(self.log_path)}")

    def postmaster_pid(self) -> int | None:
        """The postmaster's pid as written in ``postmaster.pid``, if the server runs."""
        if not self.running:
            return None
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def _shut_down(self, proc: _Process, timeout: float) -> bool:
        """Fast shutdown (SIGINT to the postmaster: roll back open transactions, disconnect
        clients, checkpoint). Escalates to immediate shutdown and SIGKILL on timeout."""
        pid = self.postmaster_pid()
        if not proc.alive:
            return True
        if pid is None:
            proc.signal_group(signal.SIGINT)
        else:
            _signal_pid(pid, signal.SIGINT)
        if proc.wait(timeout):
            return True
        log.warning("PostgreSQL fast shutdown timed out; sending SIGQUIT")
        if pid is not None:
            _signal_pid(pid, signal.SIGQUIT)
        if proc.wait(10):
            return True
        self._kill_processes()
        return False

    def kill(self) -> None:
        """Crash the server: SIGKILL the postmaster and all its children at once."""
        self._kill_processes()

    def _kill_processes(self) -> None:
        proc = self._proc
        if proc is None:
            return
        pids: list[int] = []
        pid = self.postmaster_pid()
        if pid is not None:
            # Postmaster and backends first (backends run in sessions of their own), so that
            # runuser, the postmaster's parent, reaps it: killed together, the postmaster would
            # be left to init, and a new postmaster refuses to start while the old pid exists.
            pids = [pid, *_children_of(pid)]
            for child in pids:
                _signal_pid(child, signal.SIGKILL)
            proc.wait(10)
        proc.kill()
        self._proc = None
        try:
            wait_until(lambda: all(map(_pid_gone, pids)), timeout=10, interval=0.01, what="")
        except AssertionError:
            log.warning("PostgreSQL processes %s still run after SIGKILL", pids)
        if pid is not None and _pid_gone(pid) and self.temp_dir is not None:
            # Only a zombie nobody reaped could still hold it; PostgreSQL would take it for live.
            (self.data_dir / "postmaster.pid").unlink(missing_ok=True)

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL of database ``dbname`` on this server."""
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres") -> str:
        """libpq conninfo of database ``dbname`` on this server (for plain psycopg)."""
        return psycopg.conninfo.make_conninfo(
            host=self.host, port=self.port, user=self.user, dbname=dbname
        )

    def connect(
        self, dbname: str = "postgres", *, autocommit: bool = True
    ) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo(dbname), autocommit=autocommit, connect_timeout=10)

    def __repr__(self) -> str:
        return f"<PostgresServer port={self.port} dir={self.temp_dir} running={self.running}>"


class ExternalPostgres(_External, _Databases):
    """A PostgreSQL server run by someone else: an SQLAlchemy URL whose user may CREATE DATABASE."""

    def __init__(self, admin_url: str, on_cleanup: Callable[[], None] | None = None) -> None:
        parsed = make_url(admin_url)
        if parsed.get_backend_name() != "postgresql":
            raise ValueError(f"not a PostgreSQL URL: {parsed.render_as_string()}")
        self.admin_url = parsed.set(drivername="postgresql+psycopg")
        super().__init__(on_cleanup)

    def url(self, dbname: str = "postgres") -> str:
        return self.admin_url.set(database=dbname).render_as_string(hide_password=False)

    def connect(
        self, dbname: str | None = None, *, autocommit: bool = True
    ) -> psycopg.Connection[Any]:
        url = self.admin_url if dbname is None else self.admin_url.set(database=dbname)
        params: dict[str, Any] = url.translate_connect_args(username="user", database="dbname")
        params.update((key, v if isinstance(v, str) else v[-1]) for key, v in url.query.items())
        return psycopg.connect(**params, autocommit=autocommit, connect_timeout=10)

    def __repr__(self) -> str:
        return f"<ExternalPostgres {self.admin_url.render_as_string()}>"


class RabbitMQServer(_LocalServer):
    """A private RabbitMQ node (Debian's ``rabbitmq-server``) on 127.0.0.1 and free ports, all
    of it (home, data, logs, config) in one temporary directory, with an epmd of its own. With
    ``management=True`` (the default) the management plugin listens too: ``management_url``."""

    _kind = "RabbitMQ"
    supports_vhosts = True
    username = "guest"
    password = "guest"  # noqa: S105 - RabbitMQ's default user; it may log in from loopback only

    def __init__(
        self,
        *,
        sbin_dir: Path | str = RABBITMQ_SBIN_DIR,
        extra_config: str = "",
        base_dir: Path | str | None = None,
        startup_timeout: float = 60.0,
        management: bool = True,
    ) -> None:
        self.sbin_dir = Path(sbin_dir)
        self.extra_config = extra_config
        self.startup_timeout = startup_timeout
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self.nodename = f"rabbit-{secrets.token_hex(4)}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.management_port: int | None = free_port() if management else None
        self.cookie = "".join(secrets.choice(string.ascii_uppercase) for _ in range(20))
        self._epmd: _Process | None = None

    @property
    def output_path(self) -> Path:
        """stdout and stderr of the ``rabbitmq-server`` script."""
        return self._require_temp_dir() / "rabbitmq-server.out"

    @property
    def node_log_path(self) -> Path:
        return self._require_temp_dir() / "log" / f"{self.nodename}.log"

    @property
    def env(self) -> dict[str, str]:
        """The environment of the node, to be used by every ``rabbitmqctl`` / ``erl_call``."""
        base = self._require_temp_dir()
        theirs = ("RABBITMQ_", "ERL_", "NOTIFY_SOCKET")
        env = {key: value for key, value in os.environ.items() if not key.startswith(theirs)}
        return env | {
            "HOME": str(base),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_NODE_IP_ADDRESS": LOCALHOST,
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(base / "rabbitmq.pid"),
            # The Erlang distribution port listens on all interfaces unless told otherwise.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ("-kernel inet_dist_use_interface {127,0,0,1}"),
            "ERL_EPMD_ADDRESS": LOCALHOST,
            "ERL_EPMD_PORT": str(self.epmd_port),
        }

    def _make_temp_dir(self) -> Path:
        base = Path(tempfile.mkdtemp(prefix="oi-rmq-", dir=self._base_dir))
        port, management, plugins = self.management_port, "", "[]"
        if port is not None:
            management = f"management.tcp.ip = {LOCALHOST}\nmanagement.tcp.port = {port}\n"
            plugins = "[rabbitmq_management]"
        (base / "log").mkdir()
        (base / "mnesia").mkdir()
        (base / "rabbitmq.conf").write_text(
            "# written by outbox_inbox.testing.servers\n"
            "loopback_users = none\n"
            "disk_free_limit.absolute = 10MB\n"
            "log.file.level = info\n"
            "log.console = false\n" + management + self.extra_config + "\n"
        )
        (base / "enabled_plugins").write_text(plugins + ".\n")
        # An empty env file keeps /etc/rabbitmq/rabbitmq-env.conf out.
        (base / "rabbitmq-env.conf").write_text("# written by outbox_inbox.testing.servers\n")
        cookie = base / ".erlang.cookie"
        cookie.write_text(self.cookie)
        cookie.chmod(0o400)
        return base

    @property
    def pids(self) -> frozenset[int]:
        """Process ids of the processes this object started (the node and its epmd; the Erlang
        VM's helpers are their children), e.g. to measure the server's CPU time."""
        return frozenset(proc.pid for proc in (self._proc, self._epmd) if proc is not None)

    def _start_epmd(self) -> None:
        if self._epmd is not None and self._epmd.alive:
            return
        epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
        self._epmd = _Process(
            [epmd, "-port", str(self.epmd_port), "-address", LOCALHOST],
            log_path=self._require_temp_dir() / "epmd.log",
            env=self.env,
            cwd=self.temp_dir,
        )
        deadline = time.monotonic() + 10
        while not _port_open(LOCALHOST, self.epmd_port, timeout=0.2):
            if not self._epmd.alive or time.monotonic() > deadline:
                path = self._epmd.log_path
                raise ServerError(f"epmd did not start on port {self.epmd_port}:\n{_tail(path)}")
            time.sleep(0.02)

    def _launch(self) -> _Process:
        server = self.sbin_dir / "rabbitmq-server"
        if not server.exists():
            raise ServerError(
                f"{server} not found: install Debian's rabbitmq-server package "
                "(or point OUTBOX_INBOX_RABBITMQ_SBIN_DIR at the directory that holds it)"
            )
        self._start_epmd()
        return _Process([str(server)], log_path=self.output_path, env=self.env, cwd=self.temp_dir)

    def _failure(self, message: str) -> ServerError:
        parts = [message, f"--- {self.output_path}:", _tail(self.output_path, 30)]
        if self.node_log_path.exists():
            parts += [f"--- {self.node_log_path}:", _tail(self.node_log_path, 30)]
        return ServerError("\n".join(parts))

    _probe_errors = (pika.exceptions.AMQPError,)

    def _answers(self) -> bool:
        management = self.management_port
        if management is not None and not _port_open(LOCALHOST, management, timeout=0.5):
            return False
        if not _port_open(LOCALHOST, self.port, timeout=0.5):
            return False
        pika.BlockingConnection(self.connection_parameters()).close()
        return True

    def _shut_down(self, proc: _Process, timeout: float) -> bool:
        """SIGTERM to the start script, which stops the node properly (queues and message
        stores are closed). SIGKILL if it takes longer than ``timeout``."""
        # Not the whole group: the VM's erl_child_setup helper is in it too, and its death
        # would abort the VM instead of stopping it.
        proc.send_signal(signal.SIGTERM)
        if proc.wait(timeout):
            return True
        log.warning("RabbitMQ did not stop within %ss; killing it", timeout)
        self.kill()
        return False

    def kill(self) -> None:
        """Crash the node: SIGKILL the start script and the Erlang VM at once."""
        if self._proc is not None:
            self._proc.kill()
            self._proc = None

    def _kill_processes(self) -> None:
        self.kill()
        if self._epmd is not None:
            self._epmd.kill()
            self._epmd = None
        if self.temp_dir is not None:
            # In case some Erlang process started an epmd of its own on our port.
            epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run([epmd, "-kill"], env=self.env, timeout=5)

    @property
    def url(self) -> str:
        """AMQP URL of the default vhost ``/``."""
        return self.url_for_vhost("/")

    def url_for_vhost(self, vhost: str) -> str:
        return (
            f"amqp://{self.username}:{self.password}@{self.host}:{self.port}/"
            f"{quote(vhost, safe='')}"
        )

    @property
    def management_url(self) -> str | None:
        """``http://guest:guest@127.0.0.1:PORT`` of the management HTTP API, or None if off."""
        if self.management_port is None:
            return None
        return f"http://{self.username}:{self.password}@{self.host}:{self.management_port}"

    def connection_parameters(self, vhost: str = "/") -> pika.ConnectionParameters:
        return pika.ConnectionParameters(
            host=self.host,
            port=self.port,
            virtual_host=vhost,
            credentials=pika.PlainCredentials(self.username, self.password),
            connection_attempts=1,
            socket_timeout=5,
            blocked_connection_timeout=30,
        )

    def rabbitmqctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n NODE ARGS`` with the node's environment; return its stdout."""
        ctl = [str(self.sbin_dir / "rabbitmqctl"), "-n", self.nodename, *args]
        what = f"rabbitmqctl {' '.join(args)}"
        return _run(ctl, what, env=self.env, cwd=self.temp_dir, timeout=timeout).stdout

    def eval(self, expression: str, timeout: float = 60.0) -> str:
        """Evaluate Erlang ``expression`` (ending with '.') on the node; return the printed result.
        Uses ``erl_call`` (erlang-base): ~15 ms a call, where ``rabbitmqctl eval`` takes ~0.5 s."""
        erl_call = shutil.which("erl_call") or "/usr/lib/erlang/bin/erl_call"
        args = [erl_call, "-sname", self.nodename, "-c", self.cookie, "-r", "-e"]
        what, stdin = f"erl_call {expression!r}", expression.rstrip() + "\n"
        result = _run(args, what, env=self.env, cwd=self.temp_dir, input=stdin, timeout=timeout)
        out = result.stdout.strip()
        if not out.startswith("{ok,"):
            raise ServerError(f"{what} failed:\n{out}")
        return out[len("{ok,") : -1].strip()

    def add_vhost(self, vhost: str) -> None:
        """Create ``vhost`` and give the guest user all permissions on it."""
        name = _check_name(vhost, "vhost")
        result = self.eval(
            f'{{rabbit_vhost:add(<<"{name}">>, <<"tests">>),'
            f' rabbit_auth_backend_internal:set_permissions(<<"{self.username}">>, <<"{name}">>,'
            f' <<".*">>, <<".*">>, <<".*">>, <<"tests">>)}}.'
        )
        if result.replace(" ", "") != "{ok,ok}":
            raise ServerError(f"could not create vhost {name!r}: {result}")

    def delete_vhost(self, vhost: str) -> None:
        """Delete ``vhost`` (closing its connections, dropping its queues); no error if absent."""
        name = _check_name(vhost, "vhost")
        result = self.eval(f'rabbit_vhost:delete(<<"{name}">>, <<"tests">>).')
        if result != "ok" and "no_such_vhost" not in result:
            raise ServerError(f"could not delete vhost {name!r}: {result}")

    def flush_metadata(self) -> None:
        """Write the node's metadata (vhosts, queues, exchanges, bindings) to disk now: call
        it before ``kill()`` when a test needs what it just declared to survive. RabbitMQ 3.10's
        Mnesia can hold it in a buffer after ``queue.declare-ok``, and a SIGKILL then loses the
        queue with its confirmed persistent messages (about 1 in 40 with no delay)."""
        result = self.eval("mnesia:sync_log().")
        if result != "ok":
            raise ServerError(f"mnesia:sync_log() returned {result}")

    def __repr__(self) -> str:
        return (
            f"<RabbitMQServer {self.nodename} port={self.port} dir={self.temp_dir} "
            f"running={self.running}>"
        )


class ExternalRabbitMQ(_External):
    """A RabbitMQ server run by someone else, given by its AMQP URL. Tests share its vhost."""

    supports_vhosts = False

    def __init__(self, amqp_url: str, on_cleanup: Callable[[], None] | None = None) -> None:
        self.url = amqp_url
        super().__init__(on_cleanup)

    def url_for_vhost(self, vhost: str) -> str:
        raise ServerError("vhosts cannot be created on an external RabbitMQ server")

    def __repr__(self) -> str:
        return f"<ExternalRabbitMQ {re.sub(r':[^:@/]*@', ':***@', self.url)}>"
