"""The fault kit: your own service, handlers and schema under the faults of production. A `FaultKit`
runs your service's roles as processes on private servers, commits your business transactions at a
steady rate (`FaultKit.load`), injects faults by name (`FaultKit.inject`, `FAULTS`, `KILL_POINTS`)
and checks the outcome (`outbox_inbox.testing.checker`): docs/testing.md ("Your service under
faults")."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import random
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from ..config import DB_URL_ENV, MQ_URL_ENV
from ..database import connect
from ..errors import first_line
from ..listener import Listener, combine
from ..messages import to_wire
from ..relay import outgoing
from ..service import Service
from .checker import FAILED, OK, UNKNOWN, Fault, History, Verdict, check
from .injection import (
    SmallDisk,
    blackhole,
    disk_alarm,
    disk_full,
    iptables_problem,
    memory_alarm,
    stop_postgres_immediately,
    tablespace_on_tmpfs,
    terminate_backends,
)
from .servers import PostgresServer, RabbitMQServer, _Process, _run, _tail, wait_until

log = logging.getLogger(__name__)

KILL_AT_ENV = "OUTBOX_INBOX_KILL_AT"
SERVICE_ENV = "OUTBOX_INBOX_SERVICE"
ROLES = ("relay", "receiver", "worker")

#: Where ``kill`` with ``at=`` stops a role: the `Listener` hook it dies in, and the moment.
KILL_POINTS: dict[str, tuple[str, str]] = {
    "relay.confirmed": ("relay_confirmed", "the broker confirmed a batch; its rows not marked"),
    "relay.committed": ("relay_committed", "a batch marked published and committed"),
    "receiver.stored": ("stored", "rows stored and committed; the deliveries not acked"),
    "worker.handled": ("handler_ran", "a handler ran; its effect and mark not committed"),
}

#: Effects expected by one transaction that `produce` wrote: any hashable values.
Produce = Callable[[Service, Session, int], Iterable[Hashable] | None]
ReadEffects = Callable[[Connection], Iterable[Hashable]]


class _KillAt(Listener):
    """SIGKILLs this process at the n-th call of one hook (`KILL_POINTS`)."""

    def __init__(self, point: str) -> None:
        name, _, nth = point.partition(":")
        if name not in KILL_POINTS:
            raise ValueError(f"kill point must be one of {sorted(KILL_POINTS)}, got {name!r}")
        self.calls, self.nth = 0, int(nth or 1)

        def hook(*args: object, **kwargs: object) -> None:
            self.calls += 1
            if self.calls >= self.nth:
                log.warning("killed at %s (call %d)", name, self.calls)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)

        setattr(self, KILL_POINTS[name][0], hook)


def _load(app: str | None) -> Service:
    """The service a role process runs: `app` (MODULE:ATTR) or a bare one named by the env."""
    if app is None:
        return Service(
            os.environ[SERVICE_ENV], db_url=os.environ[DB_URL_ENV], mq_url=os.environ[MQ_URL_ENV]
        )
    module_name, _, attribute = app.partition(":")
    made = getattr(importlib.import_module(module_name), attribute)
    service = made if isinstance(made, Service) else made()
    if not isinstance(service, Service):
        raise TypeError(f"{app} is not a Service nor a function returning one")
    return service


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m outbox_inbox.testing.faultkit ROLE [--app MODULE:ATTR]``: one role process."""
    parser = argparse.ArgumentParser(prog="outbox_inbox.testing.faultkit")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--app")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    service = _load(args.app)
    service.settings = replace(service.settings, processes=1)
    if os.environ.get(KILL_AT_ENV):
        service.listener = combine(service.listener, _KillAt(os.environ[KILL_AT_ENV]))
    try:
        getattr(service, f"run_{args.role}")()
    finally:
        service.close()


class RoleProcess:
    """One role of a service, as a process of its own (docs/testing.md, "The roles")."""

    def __init__(
        self, kit: FaultKit, role: str, app: str | None, service: str | None, db_url: str
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if (app is None) == (service is None):
            raise ValueError("give the role an app (MODULE:ATTR) or a service name, not both")
        self.kit, self.role, self.app, self.service, self.db_url = kit, role, app, service, db_url
        self.name = f"{app or service}-{role}".replace(":", ".")
        self.log_path = kit.workdir / f"{self.name}.log"
        self.restarts = 0
        self._process: _Process | None = None

    def start(self, kill_at: str | None = None) -> None:
        """Start the process (again); with `kill_at`, it SIGKILLs itself at that point."""
        env = self.kit._env(self.db_url)
        if kill_at is not None:
            env[KILL_AT_ENV] = kill_at
        if self.service is not None:
            env[SERVICE_ENV] = self.service
        app = ["--app", self.app] if self.app else []
        args = [sys.executable, "-m", __name__, self.role, *app]
        self._process = _Process(args, log_path=self.log_path, env=env)

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.alive

    @property
    def pid(self) -> int | None:
        """The process id of the role's current process (None before `start`)."""
        return None if self._process is None else self._process.pid

    def kill(self) -> None:
        """SIGKILL the process (and anything it started)."""
        if self._process is not None:
            self._process.kill()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the role finishes what it holds), SIGKILL after `timeout`."""
        if self._process is None:
            return
        self._process.send_signal(signal.SIGTERM)
        if not self._process.wait(timeout):
            log.warning("%s did not stop within %.0f s: killed", self.name, timeout)
        self._process.kill()

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


class Load(threading.Thread):
    """Commits transactions of `produce` through `service` at `rate` a second, into `history`,
    as docs/testing.md ("The load") says; a `produce` that returns None expects ``[n]``. A
    commit that raises is UNKNOWN (the fault may have taken only the answer); a failure before
    the commit is FAILED. Either way the load goes on with the next n."""

    def __init__(
        self,
        service: Service,
        produce: Produce,
        history: History,
        *,
        rate: float = 100.0,
        abort_every: int = 10,
        total: int | None = None,
        first: int = 1,
    ) -> None:
        super().__init__(name="faultkit-load", daemon=True)
        self.service, self.produce, self.history = service, produce, history
        self.interval, self.abort_every, self.total = 1.0 / rate, abort_every, total
        self.first, self.written = first, 0
        self.errors: list[str] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(60)

    def run(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set() and (self.total is None or self.written < self.total):
            self.written += 1
            abort = self.abort_every > 0 and self.written % self.abort_every == 0
            self._one(self.first + self.written - 1, abort=abort)
            next_at = max(next_at + self.interval, time.monotonic() - 1.0)  # no long burst
            self._stopping.wait(max(0.0, next_at - time.monotonic()))

    def _one(self, n: int, *, abort: bool) -> None:
        expects: list[Hashable] = [n]
        outcome = FAILED  # until the commit is asked for: then it may have committed
        try:
            with self.service.session() as session:
                session.begin()
                produced = self.produce(self.service, session, n)
                expects = [n] if produced is None else list(produced)
                if abort:
                    session.rollback()
                    self.history.record(expects, FAILED)
                    return
                outcome = UNKNOWN
                session.commit()
        except Exception as exc:
            self.history.record(expects, outcome)
            if len(self.errors) < 20:
                self.errors.append(f"{type(exc).__name__}: {first_line(exc)}")
            self._stopping.wait(0.2)
            return
        self.history.record(expects, OK)


class FaultKit:
    """Roles of your services as processes, a load, faults by name, and the checker.
    `postgres` and `rabbitmq` are servers of the kit's own (a fault stops and kills them): the
    fixture ``outbox_inbox_servers`` starts them. `workdir` keeps the role logs."""

    def __init__(
        self,
        postgres: PostgresServer,
        rabbitmq: RabbitMQServer,
        workdir: Path,
        *,
        path: Sequence[str | Path] = (".",),
        recovery_limit: float = 60.0,
    ) -> None:
        self.postgres, self.rabbitmq = postgres, rabbitmq
        self.workdir = Path(workdir)
        self.path = [Path(p).resolve() for p in path]
        self.recovery_limit = recovery_limit
        self.history = History()
        self.roles: list[RoleProcess] = []
        self.databases: list[str] = []
        self._effects: tuple[str, ReadEffects] | None = None
        self._loads: list[Load] = []
        self._small_disk: SmallDisk | None = None
        self._killed_after_handler = False
        self._resources = contextlib.ExitStack()
        self._suffix = secrets.token_hex(4)
        self.vhost = f"kit_{self._suffix}"
        rabbitmq.add_vhost(self.vhost)
        self.mq_url = rabbitmq.url_for_vhost(self.vhost)

    def _env(self, db_url: str) -> dict[str, str]:
        """The environment of a process of the kit: its servers, and `path` importable."""
        env = {**os.environ, DB_URL_ENV: db_url, MQ_URL_ENV: self.mq_url}
        env.pop(KILL_AT_ENV, None)
        path = [*map(str, self.path), os.environ.get("PYTHONPATH", "")]
        return env | {"PYTHONPATH": os.pathsep.join(path)}

    def database(self, name: str) -> str:
        """The URL of a new, empty database for the service `name` on the kit's PostgreSQL
        (named ``<name>_<this kit's suffix>``, dropped at `close`)."""
        database = f"{name}_{self._suffix}"
        self.postgres.create_database(database)
        self.databases.append(database)
        return self.postgres.url(database)

    def start(
        self, role: str, *, app: str | None = None, service: str | None = None, db_url: str
    ) -> RoleProcess:
        """Start `role` of `app` (MODULE:ATTR) or of a bare service named `service`."""
        process = RoleProcess(self, role, app, service, db_url)
        process.start()
        self.roles.append(process)
        return process

    def effects(self, db_url: str, read: ReadEffects) -> None:
        """Where the effects are: `read(connection)` yields one item per effect row, read from
        the database at `db_url` (your own table, written by your handlers)."""
        self._effects = (db_url, read)

    def found(self) -> list[Hashable]:
        """The effects now in the effect table (empty while the database cannot answer)."""
        if self._effects is None:
            raise RuntimeError("call effects(db_url, read) first: the kit reads your effects")
        url, read = self._effects
        engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 5})
        try:
            with engine.connect() as conn:
                return list(read(conn))
        except SQLAlchemyError:
            return []
        finally:
            engine.dispose()

    @contextlib.contextmanager
    def load(
        self, service: Service, produce: Produce, *, rate: float = 100.0, abort_every: int = 10
    ) -> Iterator[Load]:
        """Commit `produce`'s transactions through `service` while the block runs, and after it
        until one commits past the end of the last fault injected (10 s at most), so that the
        load overlaps every fault injected inside the block however soon the block ends."""
        load = Load(service, produce, self.history, rate=rate, abort_every=abort_every)
        self._loads.append(load)
        load.start()
        try:
            yield load
        finally:
            ended = [f for f in self.history.faults if f.over is not None]
            with contextlib.suppress(AssertionError):
                wait_until(
                    lambda: not ended or self.history.overlapped(ended[-1]) or not load.is_alive(),
                    timeout=10,
                    interval=0.05,
                    what="a commit after the last fault",
                )
            load.stop()

    def inject(self, name: str, **options: Any) -> Fault:
        """Inject the fault `name` (`FAULTS`), wait until it is over, and measure the recovery:
        how long until every effect committed by its end is found (`Fault.recovered_s`; None
        if not within `recovery_limit`). Returns the recorded fault."""
        if name not in FAULTS:
            raise ValueError(f"fault must be one of {sorted(FAULTS)}, got {name!r}")
        for role in self.roles:
            if not role.alive:
                raise AssertionError(f"{role.name} is not running:\n{role.log_tail()}")
        fault = self.history.begin_fault(name)
        try:
            FAULTS[name](self, **options)
        finally:
            self.history.end_fault(fault)
        self.wait_recovered(fault)
        return fault

    def wait_recovered(self, fault: Fault) -> None:
        """Wait until every effect committed by the end of `fault` is found; record how long."""
        assert fault.over is not None
        expected = self.history.expected(OK, until=fault.over)
        deadline = fault.over + self.recovery_limit
        while time.monotonic() < deadline:
            if expected <= set(self.found()):
                fault.recovered_s = time.monotonic() - fault.over
                return
            time.sleep(0.2)

    def _role(self, role: str) -> RoleProcess:
        matching = [r for r in self.roles if r.role == role or r.name == role]
        if not matching:
            raise ValueError(f"no role process {role!r}: {[r.name for r in self.roles]}")
        return random.choice(matching)

    def _kill(self, role: str, at: str | None = None, nth: int = 1, timeout: float = 60.0) -> None:
        process = self._role(role)
        process.kill()
        if at is not None:
            if at not in KILL_POINTS:
                raise ValueError(f"kill point must be one of {sorted(KILL_POINTS)}, got {at!r}")
            process.start(kill_at=f"{at}:{nth}")
            wait_until(
                lambda: not process.alive,
                timeout=timeout,
                what=f"{process.name} to reach {at} ({KILL_POINTS[at][1]})",
            )
        process.restarts += 1
        process.start()
        self._killed_after_handler |= process.role == "worker" and at == "worker.handled"

    def _postgres_restart(self, seconds: float = 2.0) -> None:
        try:
            stop_postgres_immediately(self.postgres)
            time.sleep(seconds)
        finally:
            self.postgres.start()

    def _rabbitmq_restart(self, seconds: float = 0.0) -> None:
        self.rabbitmq.flush_metadata()
        try:
            self.rabbitmq.kill()
            time.sleep(seconds)
        finally:
            self.rabbitmq.start()

    def _terminate_sessions(self, rounds: int = 3) -> None:
        for _ in range(rounds):
            terminate_backends(self.postgres, self.databases)
            time.sleep(1.0)

    def _memory_alarm(self, seconds: float = 5.0) -> None:
        with memory_alarm(self.rabbitmq):
            time.sleep(seconds)

    def _disk_alarm(self, seconds: float = 5.0) -> None:
        with disk_alarm(self.rabbitmq):
            time.sleep(seconds)

    def _disk_full(self, database: str, table: str, seconds: float = 5.0) -> None:
        """Fill the disk under `table` of the kit's `database` (a name `database()` was given)
        for `seconds`, as docs/testing.md's table of the faults says."""
        if self._small_disk is None:
            self._small_disk = self._resources.enter_context(
                tablespace_on_tmpfs(self.postgres, size_mb=64)
            )
        disk = self._small_disk
        name = f"{database}_{self._suffix}"
        if name not in disk.databases:
            disk.take_table(name, table)
        with disk_full(disk.path):
            time.sleep(seconds)

    def _blackhole(self, server: str = "rabbitmq", seconds: float = 10.0) -> None:
        iptables, why_not = iptables_problem()
        if iptables is None:
            raise RuntimeError(f"no blackhole here: {why_not}")
        port = {"rabbitmq": self.rabbitmq.port, "postgres": self.postgres.port}[server]
        with blackhole(iptables, port):
            time.sleep(seconds)

    def _duplicate(
        self, times: int = 2, last: int = 50, db_url: str | None = None, service: str | None = None
    ) -> None:
        """Publish the `last` messages a producer published again, `times` times each."""
        database = connect(db_url or self._producer_url())
        try:
            outbox = database.tables.outbox
            published = select(outbox).where(outbox.c.published_at.is_not(None))
            with database.engine.connect() as conn:
                stmt = published.order_by(outbox.c.id.desc()).limit(last)
                rows = conn.execute(stmt).mappings().all()
        finally:
            database.engine.dispose()
        wires = [to_wire(outgoing(row, service or "")) for row in reversed(rows)] * times
        from ..brokers.rabbitmq import RabbitMQBroker

        broker = RabbitMQBroker(self.mq_url)
        with contextlib.closing(broker), contextlib.closing(broker.publisher()) as publisher:
            publisher.publish_batch(wires, window=100, timeout=10.0)

    def _producer_url(self) -> str:
        relays = [r for r in self.roles if r.role == "relay"]
        if not relays:
            raise ValueError("duplicate needs db_url= of a producer, or a relay started by the kit")
        return relays[0].db_url

    def _clock_skew(
        self,
        produce: str,
        seconds: float = -600.0,
        count: int = 20,
        service: str = "writer",
        db_url: str | None = None,
    ) -> None:
        """Commit `count` transactions of `produce` (MODULE:ATTR, called as `Load` calls it) from
        a process whose wall clock is off by `seconds` (libfaketime; its monotonic clock is
        left alone), and record them in the history."""
        faketime = shutil.which("faketime")
        if faketime is None:
            raise RuntimeError("clock-skew needs libfaketime: apt-get install faketime")
        env = self._env(db_url or self._producer_url()) | {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        first = 10**9 + secrets.randbelow(10**6) * 1000  # keys no other load uses
        script = "import sys; from outbox_inbox.testing.faultkit import _skewed_writer as w"
        writer = [sys.executable, "-c", script + "; w(*sys.argv[1:])", service, produce]
        args = [faketime, "-f", f"{seconds:+.0f}s", *writer, str(count), str(first)]
        result = _run(args, "the skewed writer", env=env, timeout=120)
        for line in result.stdout.splitlines():
            entry = json.loads(line)
            self.history.record([_hashable(k) for k in entry["expects"]], entry["outcome"])

    def close(self) -> None:
        """Stop the loads and the role processes; drop the kit's databases and virtual host."""
        for load in self._loads:
            load.stop()
        for role in self.roles:
            role.stop()
        for name in reversed(self.databases):
            self.postgres.drop_database(name)
        self._resources.close()  # the small disk's tablespace and tmpfs
        self.rabbitmq.delete_vhost(self.vhost)

    def check(self) -> Verdict:
        """Wait until nothing more comes (every committed effect found, or `recovery_limit`),
        then check the history against the effects found. The verdict is refused (invalid,
        `Verdict.refused` says why) when a fault did not overlap the load, or when a worker
        ran and was never killed at ``worker.handled``."""
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: self.history.expected(OK) <= set(self.found()),
                timeout=self.recovery_limit,
                what="every committed effect",
            )
        time.sleep(1.0)  # a second effect of anything would show by now
        verdict = check(self.history, self.found())
        if any(r.role == "worker" for r in self.roles) and not self._killed_after_handler:
            unkilled = "no worker was killed after a handler ran (kill at worker.handled): a"
            unkilled += " handler writing its effect outside its session passes every other fault"
            verdict = replace(verdict, refused=(*verdict.refused, unkilled))
        return verdict


def _hashable(value: Any) -> Hashable:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _skewed_writer(service_name: str, produce_spec: str, count: str, first: str) -> None:
    """The clock-skew fault's process: `count` transactions of `produce`, one JSON line each."""
    module_name, _, attribute = produce_spec.partition(":")
    produce: Produce = getattr(importlib.import_module(module_name), attribute)
    service = Service(service_name, db_url=os.environ[DB_URL_ENV], mq_url=os.environ[MQ_URL_ENV])
    history = History()
    Load(
        service, produce, history, rate=50.0, abort_every=0, total=int(count), first=int(first)
    ).run()
    for outcome, expects in history.transactions():
        print(json.dumps({"expects": list(expects), "outcome": outcome}))
    service.close()


FAULTS: dict[str, Callable[..., None]] = {
    "kill": FaultKit._kill,
    "postgres-restart": FaultKit._postgres_restart,
    "rabbitmq-restart": FaultKit._rabbitmq_restart,
    "terminate-sessions": FaultKit._terminate_sessions,
    "memory-alarm": FaultKit._memory_alarm,
    "disk-alarm": FaultKit._disk_alarm,
    "disk-full": FaultKit._disk_full,
    "blackhole": FaultKit._blackhole,
    "duplicate": FaultKit._duplicate,
    "clock-skew": FaultKit._clock_skew,
}

if importlib.util.find_spec("pytest") is not None:
    import pytest

    @pytest.fixture(scope="session")
    def outbox_inbox_servers() -> Iterator[tuple[PostgresServer, RabbitMQServer]]:
        """A private PostgreSQL and RabbitMQ on loopback for the session's fault kits, started
        once and removed at its end (docs/testing.md, "The fixtures": how to bring your own)."""
        with PostgresServer() as postgres, RabbitMQServer() as rabbitmq:
            yield postgres, rabbitmq

    @pytest.fixture
    def outbox_inbox_fault_kit(
        outbox_inbox_servers: tuple[PostgresServer, RabbitMQServer],
        tmp_path: Path,
        request: pytest.FixtureRequest,
    ) -> Iterator[FaultKit]:
        """A `FaultKit` on the session's servers, its role logs in ``tmp_path``, closed after
        the test (docs/testing.md: "The fixtures"; what its roles import: "The roles")."""
        path = [Path(request.node.path).parent, request.config.rootpath]
        with contextlib.closing(FaultKit(*outbox_inbox_servers, tmp_path, path=path)) as kit:
            yield kit


if __name__ == "__main__":
    main()


__all__ = ["FaultKit"]
