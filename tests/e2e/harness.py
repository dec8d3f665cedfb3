"""Helpers of the end-to-end tests: service processes, bounded waits, database probes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pika
from psycopg import sql
from sqlalchemy import Engine, create_engine, text

from outbox_inbox import Service
from outbox_inbox.config import broker_urls
from outbox_inbox.testing.injection import StreamingReplica

from . import apps

T = TypeVar("T")

APPS = Path(apps.__file__).resolve()


class WaitTimeout(AssertionError):
    """A condition did not become true before its deadline."""


def wait_until(
    condition: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = 0.1,
    describe: Callable[[], object] | None = None,
) -> T:
    """Call `condition` until it returns something truthy, and return that.

    Raises WaitTimeout after `timeout` seconds, naming `what` and, if given, what `describe()`
    says about the state at that moment.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            state = f"; state: {describe()}" if describe is not None else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{state}")
        time.sleep(interval)


def make_synchronous(replica: StreamingReplica) -> None:
    """Make every commit on `replica`'s primary wait for `replica`'s flush
    (``synchronous_standby_names``; ``synchronous_commit = on``), once it streams so."""
    with replica.primary.connect() as conn:
        names = sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}")
        conn.execute(names.format(sql.Literal(replica.name)))
        conn.execute("SELECT pg_reload_conf()")
    wait_until(lambda: replica.streaming("sync"), timeout=30, what="a synchronous standby")


def hold(duration: float, invariant: Callable[[], T], *, what: str) -> T:
    """Check `invariant` repeatedly for `duration` seconds; fail at once if it turns false."""
    deadline = time.monotonic() + duration
    value = invariant()
    while True:
        if not value:
            raise AssertionError(f"{what} stopped holding")
        if time.monotonic() >= deadline:
            return value
        time.sleep(0.1)
        value = invariant()


class Database:
    """A small probe of one test database: run a statement, get a value or rows."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = create_engine(url, pool_size=2, max_overflow=2)

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def rows(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(sql), params))

    def count(self, table: str, where: str = "true", **params: Any) -> int:
        """Rows of `table` matching `where` (both written by the tests, never input)."""
        return int(self.scalar(f"SELECT count(*) FROM {table} WHERE {where}", **params))

    def sessions(self) -> list[tuple[Any, ...]]:
        """The other sessions of this database as a failure message wants them: pid, state,
        what it waits on, the age of its transaction, its query (cut), and the advisory locks
        it holds (worker liveness)."""
        return [
            tuple(r)
            for r in self.rows(
                "SELECT a.pid, a.state, a.wait_event_type, a.wait_event,"
                " round(extract(epoch FROM now() - a.xact_start)::numeric, 1),"
                " left(regexp_replace(a.query, '\\s+', ' ', 'g'), 80),"
                " (SELECT count(*) FROM pg_locks l"
                "  WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)"
                " FROM pg_stat_activity a"
                " WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()"
                " ORDER BY a.pid"
            )
        ]

    def dispose(self) -> None:
        self.engine.dispose()


def queue_depth(mq_url: str, queue: str) -> int:
    """Messages ready in `queue` (unacknowledged ones not counted); `mq_url` may name several
    nodes of a cluster (the first that answers is asked)."""
    connection = pika.BlockingConnection([pika.URLParameters(u) for u in broker_urls(mq_url)])
    try:
        result = connection.channel().queue_declare(queue, passive=True)
        return int(result.method.message_count)
    finally:
        connection.close()


OUTBOX = "outbox_inbox.outbox_messages"
INBOX = "outbox_inbox.inbox_messages"


class ServiceProcess:
    """One `apps.py` process: its Popen, its log file, and how to signal it."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.signalled = False  # the test ended it on purpose: its exit is no failure

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the process itself (not its group: a role has no children)."""
        self.signalled = True
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def entered_role(self) -> bool:
        """True once the process has imported everything and is entering its role."""
        try:
            return apps.STARTING in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            content = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(content[-lines:])


class Processes:
    """Starts `apps.py` processes and guarantees each is SIGKILLed and reaped at teardown."""

    def __init__(self, log_dir: Path, db_url: str, mq_url: str) -> None:
        self._log_dir = log_dir
        self.log_dir = log_dir  # the processes' logs: a test may keep files of its own there
        self._db_url = db_url
        self._mq_url = mq_url
        self.started: list[ServiceProcess] = []

    def start(
        self,
        role: str,
        *,
        service: str = "billing",
        settings: Mapping[str, Any] | None = None,
        db_url: str | None = None,
        pause_after_confirm: Path | None = None,
        hang_marker: Path | None = None,
        handle_delay: float | None = None,
        record_relayed: bool = False,
        batch: bool = False,
        event_log: Path | None = None,
    ) -> ServiceProcess:
        """Start one role of `service` in a new process (from the main thread: see apps.py)."""
        name = f"{service}-{role}-{len(self.started)}"
        argv = [sys.executable, str(APPS), role, "--service", service]
        argv += ["--settings", json.dumps(dict(settings or {}))]
        if pause_after_confirm is not None:
            argv += ["--pause-after-confirm", str(pause_after_confirm)]
        if hang_marker is not None:
            argv += ["--hang-marker", str(hang_marker)]
        if handle_delay is not None:
            argv += ["--handle-delay", str(handle_delay)]
        if record_relayed:
            argv.append("--record-relayed")
        if batch:
            argv.append("--batch")
        if event_log is not None:
            argv += ["--event-log", str(event_log)]
        env = dict(os.environ)
        env[apps.DB_URL_ENV] = db_url or self._db_url
        env[apps.MQ_URL_ENV] = self._mq_url
        env[apps.PARENT_PID_ENV] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        log_path = self._log_dir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C at the terminal does not reach it
            )
        process = ServiceProcess(name, popen, log_path)
        self.started.append(process)
        return process

    def check(self) -> None:
        """Fail if a process that the test did not signal has exited (e.g. crashed at start)."""
        for process in self.started:
            if not process.signalled and not process.alive():
                raise AssertionError(
                    f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}"
                )

    def wait_started(self, timeout: float = 60.0) -> None:
        """Wait until every process has entered its role (imports take seconds on a busy host)."""
        self.wait_until(
            lambda: all(p.entered_role() for p in self.started if p.alive()),
            timeout=timeout,
            what="the service processes to start",
        )

    def wait_until(
        self, condition: Callable[[], T], *, timeout: float, what: str, **kwargs: Any
    ) -> T:
        """`wait_until` that also fails at once if one of the processes died unexpectedly."""

        def checked() -> T:
            self.check()
            return condition()

        return wait_until(checked, timeout=timeout, what=what, **kwargs)

    def describe(self) -> str:
        return "\n".join(
            f"--- {p.name} (pid {p.pid}, exit {p.popen.poll()}):\n{p.log_tail()}"
            for p in self.started
        )

    def kill_all(self) -> None:
        for process in self.started:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(10)


@contextlib.contextmanager
def running(*services: Service, **start: Any) -> Iterator[None]:
    """Run services in this process (`start(**start)`) and stop them however the block ends."""
    started: list[Service] = []
    try:
        for service in services:
            service.start(**start)
            started.append(service)
        yield
    finally:
        for service in reversed(started):
            service.stop(timeout=10)
