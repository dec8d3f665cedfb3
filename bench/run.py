"""Benchmark: the raw limits of PostgreSQL + RabbitMQ next to the outbox_inbox roles, as ratios.

    .venv/bin/python bench/run.py [--messages 20000] [--db-url URL] [--mq-url URL] [--json FILE]

Without --db-url / --mq-url it starts its own PostgreSQL and RabbitMQ with tests/servers.py.
Everything runs in one process, on the same servers, one phase after the other. bench/README.md
explains each figure. This is a benchmark, not a test: it only fails when a phase cannot finish.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import platform
import pstats
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pika
import pika.exceptions
import psycopg
import sqlalchemy
from pika.spec import Basic, BasicProperties
from psycopg import sql
from psycopg.types.json import Jsonb
from sqlalchemy import BigInteger, Column, Identity, Integer, MetaData, Table, Uuid, insert
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from outbox_inbox import Service  # noqa: E402
from outbox_inbox.broker import PublishOutcome  # noqa: E402
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker  # noqa: E402
from outbox_inbox.messages import (  # noqa: E402
    EVENT,
    EVENTS_EXCHANGE,
    Message,
    OutgoingMessage,
    WireMessage,
    from_wire,
    to_wire,
)

log = logging.getLogger("bench")

WINDOW = 500  # unconfirmed publishes in flight (the library's publish_window default)
PREFETCH = 500  # consumer prefetch (the library's prefetch default)
ACK_EVERY = 250  # raw consumer: one multiple-ack per this many deliveries
INSERT_BATCH = 250  # raw inbox insert: rows per statement and commit (receive_batch_size)
CLAIM_BATCH = 50  # raw claim: rows per claim (worker_batch_size)
OUTBOX_TXN = 500  # messages per business transaction when filling an outbox
SYNC_CONFIRM_SECONDS = 5.0  # (a') publishes one by one for at most this long
EVENT_NAME = "order.placed"


class BenchError(RuntimeError):
    """A phase could not finish."""


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float | None:
    """CPU seconds all cores of this machine spent busy since boot (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def _tree_cpu_seconds(roots: frozenset[int]) -> float | None:
    """CPU seconds used by these processes, their descendants and their reaped children.

    By process tree, not process group: PostgreSQL backends each call setsid().
    """
    if not roots:
        return None
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, clock ticks)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()  # from field 3 (state) on
        if len(fields) > 14:
            # ppid; utime stime cutime cstime
            stats[int(entry.name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / CLOCK_TICKS


class Timer:
    """Wall time, and CPU cores busy meanwhile: the bench's processes (all threads), the servers
    it started, and everything else on the machine."""

    server_pids: frozenset[int] = frozenset()

    def __init__(self, extra_pids: frozenset[int] = frozenset()) -> None:
        self.extra_pids = extra_pids  # processes of the bench besides this one (trees)
        self.seconds = 0.0
        self.client_cores: float | None = None
        self.server_cores: float | None = None
        self.other_cores: float | None = None
        self._t0 = self._cpu0 = 0.0
        self._busy0: float | None = None
        self._servers0: float | None = None

    def start(self) -> None:
        self._busy0 = _machine_busy_seconds()
        self._servers0 = _tree_cpu_seconds(self.server_pids)
        self._cpu0 = time.process_time() + (_tree_cpu_seconds(self.extra_pids) or 0.0)
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self.seconds <= 0:
            return
        cpu1 = time.process_time() + (_tree_cpu_seconds(self.extra_pids) or 0.0)
        self.client_cores = (cpu1 - self._cpu0) / self.seconds
        busy1 = _machine_busy_seconds()
        servers1 = _tree_cpu_seconds(self.server_pids)
        if self._servers0 is not None and servers1 is not None:
            self.server_cores = (servers1 - self._servers0) / self.seconds
        if self._busy0 is not None and busy1 is not None:
            machine = (busy1 - self._busy0) / self.seconds
            self.other_cores = max(0.0, machine - self.client_cores - (self.server_cores or 0))

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class Figure:
    key: str
    title: str
    group: str  # "raw" or "library"
    unit: str = "msg/s"
    count: int = 0
    seconds: float = 0.0
    client_cores: float | None = None
    server_cores: float | None = None
    other_cores: float | None = None
    limit_of: tuple[str, ...] = ()  # the raw figure(s) this one is compared with (min of them)
    limit: float | None = None
    note: str = ""
    samples: list[float] = dataclasses.field(default_factory=list)  # rates of repeated attempts

    @property
    def rate(self) -> float | None:
        return self.count / self.seconds if self.count and self.seconds > 0 else None

    @property
    def cpu_us(self) -> float | None:
        """CPU microseconds the bench's processes spent per message (robust to a busy machine)."""
        if not self.count or self.client_cores is None:
            return None
        return self.client_cores * self.seconds / self.count * 1e6

    @property
    def ratio(self) -> float | None:
        rate = self.rate
        return rate / self.limit if rate is not None and self.limit else None

    def took(self, count: int, timer: Timer) -> Figure:
        self.count = count
        self.seconds = timer.seconds
        self.client_cores = timer.client_cores
        self.server_cores = timer.server_cores
        self.other_cores = timer.other_cores
        return self

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["limit_of"] = list(self.limit_of)
        data["rate"] = self.rate
        data["ratio"] = self.ratio
        data["cpu_us_per_message"] = self.cpu_us
        return data


# --------------------------------------------------------------------------------------------
# Threads the bench starts (role loops), stopped on every exit path
# --------------------------------------------------------------------------------------------


class Threads:
    """Background threads running ``target(stop_event)``; optionally each under cProfile."""

    def __init__(self) -> None:
        self._running: list[tuple[threading.Thread, threading.Event]] = []
        self.errors: list[str] = []
        self.profile = False
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def start(self, name: str, target: Callable[[threading.Event], object]) -> None:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(name, target, stop), name=f"bench-{name}", daemon=True
        )
        self._running.append((thread, stop))
        thread.start()

    def _run(self, name: str, target: Callable[[threading.Event], object], stop: threading.Event):
        try:
            if self.profile:
                profiler = cProfile.Profile()
                try:
                    profiler.runcall(target, stop)
                finally:
                    with self._lock:
                        self._profiles.append(profiler)
            else:
                target(stop)
        except BaseException as exc:
            log.exception("thread %s failed", name)
            self.errors.append(f"{name}: {exc!r}")

    def stop_all(self, timeout: float = 30.0) -> None:
        for _thread, stop in self._running:
            stop.set()
        deadline = time.monotonic() + timeout
        for thread, _stop in self._running:
            thread.join(max(0.1, deadline - time.monotonic()))
        alive = [t.name for t, _ in self._running if t.is_alive()]
        self._running = []
        if alive:
            log.warning("threads still running after %.0f s: %s", timeout, alive)

    def take_profiles(self) -> list[cProfile.Profile]:
        with self._lock:
            profiles, self._profiles = self._profiles, []
        return profiles


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, threads: Threads) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if threads.errors:
            raise BenchError(f"{what}: {threads.errors[0]}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not finished after {timeout:.0f} s")
        time.sleep(0.01)


# --------------------------------------------------------------------------------------------
# Messages: the library's own wire format, so raw figures move messages of the same size
# --------------------------------------------------------------------------------------------


def payload(i: int) -> dict[str, Any]:
    return {
        "order_id": i,
        "customer": f"customer-{i % 1000:04d}",
        "amount_cents": 1999 + i % 500,
        "currency": "EUR",
        "lines": [{"sku": f"SKU-{i % 97:04d}", "qty": 1 + i % 3}, {"sku": "SKU-0042", "qty": 1}],
    }


def make_wires(n: int, source: str, exchange: str, routing_key: str) -> list[WireMessage]:
    """N messages exactly as the relay would put them on the wire."""
    now = datetime.now(UTC)
    wires = []
    for i in range(n):
        mid = uuid.uuid4()
        message = OutgoingMessage(
            id=i + 1,
            message_id=mid,
            kind=EVENT,
            exchange=exchange,
            routing_key=routing_key,
            payload=payload(i),
            headers={},
            source=source,
            correlation_id=str(mid),
            created_at=now,
        )
        wires.append(to_wire(message))
    return wires


def pika_properties(wire: WireMessage) -> BasicProperties:
    return BasicProperties(
        message_id=wire.message_id,
        type=wire.type,
        correlation_id=wire.correlation_id,
        content_type=wire.content_type,
        timestamp=wire.timestamp,
        priority=wire.priority,
        app_id=wire.app_id,
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=dict(wire.headers),
    )


# --------------------------------------------------------------------------------------------
# Raw RabbitMQ
# --------------------------------------------------------------------------------------------


def raw_publish_window(
    params: pika.ConnectionParameters,
    exchange: str,
    routing_key: str,
    wires: Sequence[WireMessage],
    window: int,
    timeout: float,
) -> Timer:
    """(a) SelectConnection, confirm mode, up to `window` unconfirmed, refilled on each confirm."""
    n = len(wires)
    timer = Timer()
    state: dict[str, Any] = {"sent": 0, "through": 0, "nacked": 0, "error": None, "done": False}
    singles: set[int] = set()  # tags above `through` confirmed one by one
    channel_box: list[Any] = []

    def confirmed() -> int:
        return int(state["through"]) + len(singles)

    def pump() -> None:
        channel = channel_box[0]
        while state["sent"] < n and state["sent"] - confirmed() < window:
            wire = wires[state["sent"]]
            channel.basic_publish(
                exchange, routing_key, wire.body, properties=pika_properties(wire), mandatory=True
            )
            state["sent"] += 1

    def on_confirm(frame: Any) -> None:
        method = frame.method
        if not isinstance(method, Basic.Ack):
            state["nacked"] += 1
        tag = int(method.delivery_tag)
        if method.multiple:
            if tag > state["through"]:
                state["through"] = tag
                for t in [t for t in singles if t <= tag]:
                    singles.discard(t)
        elif tag > state["through"]:
            singles.add(tag)
        while state["through"] + 1 in singles:
            singles.discard(state["through"] + 1)
            state["through"] += 1
        if confirmed() >= n:
            timer.stop()
            state["done"] = True
            connection.close()
        else:
            pump()

    def on_select_ok(_frame: Any) -> None:
        timer.start()
        pump()

    def on_channel(channel: Any) -> None:
        channel_box.append(channel)
        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=on_select_ok)

    def on_open(conn: Any) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_open_error(_conn: Any, error: Any) -> None:
        state["error"] = f"cannot connect: {error!r}"
        connection.ioloop.stop()

    def on_close(_conn: Any, reason: Any) -> None:
        if not state["done"] and state["error"] is None:
            state["error"] = f"connection closed: {reason!r}"
        connection.ioloop.stop()

    def on_timeout() -> None:
        state["error"] = f"timeout after {timeout:.0f} s ({confirmed()} of {n} confirmed)"
        connection.close()

    connection = pika.SelectConnection(
        params,
        on_open_callback=on_open,
        on_open_error_callback=on_open_error,
        on_close_callback=on_close,
    )
    connection.ioloop.call_later(timeout, on_timeout)
    try:
        connection.ioloop.start()
    finally:
        if not connection.is_closed:
            with contextlib.suppress(Exception):
                connection.close()
                connection.ioloop.call_later(5, connection.ioloop.stop)
                connection.ioloop.start()
    if state["error"]:
        raise BenchError(f"raw publish: {state['error']}")
    if state["nacked"]:
        raise BenchError(f"raw publish: {state['nacked']} nacks")
    return timer


def raw_publish_sync(
    params: pika.ConnectionParameters,
    exchange: str,
    routing_key: str,
    wires: Sequence[WireMessage],
    max_seconds: float,
) -> tuple[int, Timer]:
    """(a') BlockingChannel.confirm_delivery: every basic_publish waits for its own confirm."""
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        sent = 0
        with Timer() as timer:
            deadline = time.perf_counter() + max_seconds
            for wire in wires:
                channel.basic_publish(
                    exchange, routing_key, wire.body, pika_properties(wire), mandatory=True
                )
                sent += 1
                if time.perf_counter() > deadline:
                    break
        return sent, timer
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def raw_consume(params: pika.ConnectionParameters, queue: str, n: int, timeout: float) -> Timer:
    """(b) BlockingConnection + basic_consume callback, prefetch 500, a multiple-ack per 250."""
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        received = 0

        def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
            nonlocal received
            if received >= n:
                return  # prefetched beyond this attempt: unacked, requeued when we close
            received += 1
            if received % ACK_EVERY == 0 or received == n:
                ch.basic_ack(method.delivery_tag, multiple=True)

        timer = Timer()
        timer.start()
        tag = channel.basic_consume(queue, on_message)
        deadline = time.monotonic() + timeout
        while received < n:
            if time.monotonic() > deadline:
                raise BenchError(f"raw consume: {received} of {n} after {timeout:.0f} s")
            connection.process_data_events(time_limit=0.5)
        timer.stop()
        channel.basic_cancel(tag)
        return timer
    finally:
        with contextlib.suppress(Exception):
            connection.close()


# --------------------------------------------------------------------------------------------
# Raw PostgreSQL
# --------------------------------------------------------------------------------------------

INBOX_COLUMNS = (
    "message_id",
    "source",
    "kind",
    "routing_key",
    "payload",
    "headers",
    "version",
    "correlation_id",
    "causation_id",
    "key",
    "priority",
    "created_at",
    "expires_at",
)
JSON_COLUMNS = frozenset({"payload", "headers"})
OUTBOX_COLUMNS = (
    "message_id",
    "kind",
    "exchange",
    "routing_key",
    "payload",
    "headers",
    "version",
    "key",
    "priority",
    "expires_at",
    "correlation_id",
    "causation_id",
)


def _values(row: dict[str, Any], columns: Sequence[str]) -> list[Any]:
    return [Jsonb(row[c]) if c in JSON_COLUMNS else row[c] for c in columns]


def raw_batch_insert(conninfo: str, table: sql.Composable, rows: Sequence[dict[str, Any]]) -> Timer:
    """(c) multi-VALUES INSERT .. ON CONFLICT DO NOTHING RETURNING id, 250 rows, commit each."""
    cols = sql.SQL(", ").join(map(sql.Identifier, INBOX_COLUMNS))
    one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(INBOX_COLUMNS)))

    def statement(k: int) -> sql.Composed:
        return sql.SQL(
            "INSERT INTO {} ({}) VALUES {} ON CONFLICT (message_id) DO NOTHING RETURNING id"
        ).format(table, cols, sql.SQL(", ").join([one] * k))

    with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
        full = statement(INSERT_BATCH).as_string(conn)
        with Timer() as timer:
            for start in range(0, len(rows), INSERT_BATCH):
                chunk = rows[start : start + INSERT_BATCH]
                params = [v for row in chunk for v in _values(row, INBOX_COLUMNS)]
                query = full if len(chunk) == INSERT_BATCH else statement(len(chunk))
                cur.execute(query, params)
                cur.fetchall()
                conn.commit()
    return timer


def raw_single_inserts(conninfo: str, table: sql.Composable, rows: Sequence[dict]) -> Timer:
    """(c') one INSERT per message, commit per 500: outbox.publish() minus the library."""
    cols = sql.SQL(", ").join(map(sql.Identifier, OUTBOX_COLUMNS))
    marks = sql.SQL(", ").join(sql.Placeholder() * len(OUTBOX_COLUMNS))
    with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
        query = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(table, cols, marks)
        with Timer() as timer:
            for i, row in enumerate(rows, 1):
                cur.execute(query, _values(row, OUTBOX_COLUMNS))
                if i % OUTBOX_TXN == 0:
                    conn.commit()
            conn.commit()
    return timer


def raw_claim(
    conninfo: str, table: sql.Composable, effects: sql.Composable | None, savepoints: bool
) -> tuple[int, Timer]:
    """(d) claim 50 pending rows FOR UPDATE SKIP LOCKED, mark them processed, commit; repeat.

    With `effects`, also insert one row per claimed row (d'), each in a savepoint if asked (d'').
    """
    claim = sql.SQL(
        "SELECT * FROM {} WHERE status = 'pending' ORDER BY priority DESC, id "
        "LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(table)
    mark = sql.SQL(
        "UPDATE {} SET status = 'processed', processed_at = now(), finished = finished + 1 "
        "WHERE id = ANY(%s)"
    ).format(table)
    effect = (
        sql.SQL("INSERT INTO {} (message_id, order_id) VALUES (%s, %s)").format(effects)
        if effects is not None
        else None
    )
    done = 0
    with (
        psycopg.connect(conninfo) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
        Timer() as timer,
    ):
        while True:
            rows = cur.execute(claim, (CLAIM_BATCH,)).fetchall()
            if not rows:
                conn.commit()
                break
            if effect is not None:
                for row in rows:
                    if savepoints:
                        cur.execute("SAVEPOINT handler")
                    cur.execute(effect, (row["message_id"], row["payload"]["order_id"]))
                    if savepoints:
                        cur.execute("RELEASE SAVEPOINT handler")
            cur.execute(mark, ([row["id"] for row in rows],))
            conn.commit()
            done += len(rows)
    return done, timer


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def load_servers_module() -> ModuleType:
    """tests/servers.py, imported by path (it is a plain module, not a package)."""
    path = ROOT / "tests" / "servers.py"
    spec = importlib.util.spec_from_file_location("outbox_inbox_bench_servers", path)
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def sqlalchemy_db_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise SystemExit(f"--db-url must be a PostgreSQL URL, got {parsed.get_backend_name()}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def psycopg_conninfo(url: str) -> str:
    parsed = make_url(url)
    params: dict[str, Any] = {
        "host": parsed.host,
        "port": parsed.port,
        "user": parsed.username,
        "password": parsed.password,
        "dbname": parsed.database,
    }
    for key, value in parsed.query.items():
        params[key] = value if isinstance(value, str) else value[-1]
    return psycopg.conninfo.make_conninfo(**{k: v for k, v in params.items() if v is not None})


def service_names(tag: str) -> tuple[str, str]:
    return f"bench-{tag}-a", f"bench-{tag}-b"


def build_service_a(tag: str, db_url: str, mq_url: str) -> Service:
    """Service A: only writes to its outbox (events ``<A>.order.placed``)."""
    return Service(service_names(tag)[0], db_url=db_url, mq_url=mq_url, schema=f"bench_{tag}_a")


def build_service_b(tag: str, db_url: str, mq_url: str) -> tuple[Service, Table]:
    """Service B: subscribes to A's events; its handler inserts one row per message."""
    a_name, b_name = service_names(tag)
    svc = Service(b_name, db_url=db_url, mq_url=mq_url, schema=f"bench_{tag}_b")
    effects = Table(
        "bench_effects",
        MetaData(schema=svc.settings.schema),
        Column("id", BigInteger, Identity(), primary_key=True),
        Column("message_id", Uuid(as_uuid=True), nullable=False),
        Column("order_id", Integer, nullable=False),
    )

    @svc.on_event(f"{a_name}.{EVENT_NAME}")
    def on_order_placed(message: Message, session: Any) -> None:
        session.execute(
            insert(effects),
            {"message_id": message.message_id, "order_id": message.payload["order_id"]},
        )

    return svc, effects


def serve_b(tag: str, db_url: str, mq_url: str, ready: Any, stop: Any) -> None:
    """Child process of (h): service B with svc.start(), as its own process, until `stop`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [B] %(name)s: %(message)s")
    svc, _ = build_service_b(tag, db_url, mq_url)
    try:
        svc.start()
        ready.set()
        stop.wait()
    finally:
        svc.close()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.messages
        self.timeout: float = args.phase_timeout
        self.raw_repeats: int = args.raw_repeats
        self.tag = uuid.uuid4().hex[:8]
        self.figures: dict[str, Figure] = {}
        self.threads = Threads()
        self.threads.profile = bool(args.profile)
        self.profile_dir: Path | None = Path(args.profile) if args.profile else None
        self.servers: list[Any] = []
        self.children: list[tuple[Any, Any]] = []  # (process, stop event)
        self.services: list[Service] = []
        self.external = False
        self.environment: dict[str, Any] = {}
        # filled by setup()
        self.db_url = self.conninfo = self.mq_url = ""
        self.params: pika.URLParameters | None = None
        self.raw_schema = f"bench_{self.tag}_raw"
        self.raw_exchange = f"bench-{self.tag}-raw"
        self.raw_queue = f"bench-{self.tag}-raw"
        self.raw_sync_queue = f"bench-{self.tag}-raw-sync"

    # -- helpers ---------------------------------------------------------------------------

    def t(self, name: str) -> sql.Composed:
        """A table of the raw schema."""
        return sql.Identifier(self.raw_schema, name)

    def sql(self, *statements: str | sql.Composable, autocommit: bool = True) -> None:
        with psycopg.connect(self.conninfo, autocommit=autocommit) as conn:
            for statement in statements:
                conn.execute(statement)  # type: ignore[arg-type]

    def scalar(self, statement: str | sql.Composable) -> Any:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(statement).fetchone()  # type: ignore[arg-type]
            return row[0] if row else None

    def vacuum(self, *tables: sql.Composable) -> None:
        self.sql(*(sql.SQL("VACUUM ANALYZE {}").format(t) for t in tables))

    def queue_depth(self, queue: str) -> int:
        connection = pika.BlockingConnection(self.params)
        try:
            result = connection.channel().queue_declare(queue, passive=True)
            return int(result.method.message_count)
        finally:
            connection.close()

    def purge(self, queue: str) -> None:
        connection = pika.BlockingConnection(self.params)
        try:
            connection.channel().queue_purge(queue)
        finally:
            connection.close()

    def record(self, figure: Figure) -> Figure:
        self.figures[figure.key] = figure
        rate = figure.rate
        print(
            f"  {figure.key:<4} {figure.title:<56} "
            f"{_fmt(rate):>9} {figure.unit}  ({figure.count} in {figure.seconds:.2f} s)"
            + (f"  best of {', '.join(_fmt(r) for r in figure.samples)}" if figure.samples else ""),
            flush=True,
        )
        return figure

    def dump_profiles(self, key: str) -> None:
        profiles = self.threads.take_profiles()
        if not profiles or self.profile_dir is None:
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        out = io.StringIO()
        stats = pstats.Stats(profiles[0], stream=out)
        for extra in profiles[1:]:
            stats.add(extra)
        path = self.profile_dir / f"{key.replace(chr(39), 'p')}.prof"
        stats.dump_stats(str(path))
        stats.sort_stats("tottime").print_stats(25)
        print(f"\n--- profile of ({key}) -> {path}, top 25 by own time ---")
        print("\n".join(out.getvalue().splitlines()[:45]))

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        args = self.args
        servers_module: ModuleType | None = None
        if not args.db_url or not args.mq_url:
            servers_module = load_servers_module()
        if args.db_url:
            self.db_url = sqlalchemy_db_url(args.db_url)
            self.external = True
        else:
            assert servers_module is not None
            print("starting PostgreSQL ...", flush=True)
            pg = servers_module.PostgresServer()
            self.servers.append(pg)
            pg.start()
            self.db_url = pg.url("postgres")
        if args.mq_url:
            self.mq_url = args.mq_url
            self.external = True
        else:
            assert servers_module is not None
            print("starting RabbitMQ ...", flush=True)
            mq = servers_module.RabbitMQServer()
            self.servers.append(mq)
            mq.start()
            self.mq_url = mq.url
        self.conninfo = psycopg_conninfo(self.db_url)
        self.params = pika.URLParameters(self.mq_url)
        Timer.server_pids = frozenset(
            proc.pid
            for server in self.servers
            for proc in (getattr(server, "_proc", None), getattr(server, "_epmd", None))
            if proc is not None
        )

        a_name, _ = service_names(self.tag)
        self.a = build_service_a(self.tag, self.db_url, self.mq_url)
        self.b, self.effects = build_service_b(self.tag, self.db_url, self.mq_url)
        self.services += [self.a, self.b]
        b_schema = self.b.settings.schema
        effects = self.effects

        self.a.migrate()
        self.b.migrate()
        effects.create(self.b.engine)
        self.a.declare_topology()
        self.b.declare_topology()

        a_out = sql.Identifier(self.a.settings.schema, "outbox_messages")
        b_in = sql.Identifier(b_schema, "inbox_messages")
        self.sql(
            sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.raw_schema)),
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(self.t("inbox"), b_in),
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(self.t("outbox"), a_out),
            sql.SQL(
                "CREATE TABLE {} (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
                "message_id uuid NOT NULL, order_id integer NOT NULL)"
            ).format(self.t("effects")),
        )
        connection = pika.BlockingConnection(self.params)
        try:
            channel = connection.channel()
            channel.exchange_declare(self.raw_exchange, "topic", durable=True)
            for queue, key in ((self.raw_queue, "raw.window"), (self.raw_sync_queue, "raw.sync")):
                channel.queue_declare(queue, durable=True)
                channel.queue_bind(queue, self.raw_exchange, key)
            server = connection._impl.server_properties or {}
            mq_version = server.get("version", b"")
        finally:
            connection.close()

        self.environment = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "postgresql": self.scalar("SHOW server_version"),
            "rabbitmq": mq_version.decode() if isinstance(mq_version, bytes) else mq_version,
            "pika": pika.__version__,
            "psycopg": psycopg.__version__,
            "sqlalchemy": sqlalchemy.__version__,
            "servers": "external" if self.external else "started by the bench",
            "library_commit": _git("rev-parse", "--short", "HEAD"),
            "library_dirty": bool(_git("status", "--porcelain", "--", "outbox_inbox")),
        }
        self.wires = make_wires(self.n, a_name, EVENTS_EXCHANGE, f"{a_name}.{EVENT_NAME}")
        body = sum(len(w.body) for w in self.wires) / self.n
        self.environment["body_bytes"] = round(body, 1)
        env = self.environment
        print(
            f"\n{self.n} messages of {body:.0f} body bytes + {len(self.wires[0].headers)} headers;"
            f" PostgreSQL {env['postgresql']}, RabbitMQ {env['rabbitmq']}, {env['cpus']} CPUs\n",
            flush=True,
        )

    # -- raw limits ------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Untimed: a first round trip through both servers, so no figure pays for a cold start."""
        assert self.params is not None
        k = min(1000, self.n)
        wires = make_wires(k, "warm-up", self.raw_exchange, "raw.window")
        raw_publish_window(self.params, self.raw_exchange, "raw.window", wires, WINDOW, 60)
        raw_consume(self.params, self.raw_queue, k, 60)
        raw_batch_insert(self.conninfo, self.t("inbox"), [from_wire(w) for w in wires])
        self.sql(sql.SQL("TRUNCATE {}").format(self.t("inbox")))

    def best_of(
        self,
        figure: Figure,
        attempt: Callable[[], tuple[int, Timer]],
        before: Callable[[], None] | None = None,
    ) -> Figure:
        """A raw limit is the best of `--raw-repeats` attempts: a busy machine only slows one."""
        best: tuple[float, int, Timer] | None = None
        for _ in range(self.raw_repeats):
            if before is not None:
                before()
            count, timer = attempt()
            rate = count / timer.seconds if timer.seconds > 0 else 0.0
            figure.samples.append(round(rate, 1))
            if best is None or rate > best[0]:
                best = (rate, count, timer)
        assert best is not None
        figure.took(best[1], best[2])
        return self.record(figure)

    def raw_rabbitmq(self) -> None:
        assert self.params is not None
        params, n = self.params, self.n
        print(f"raw limits (best of {self.raw_repeats})", flush=True)
        # (a) and (b) alternate, so each publishing attempt starts on an empty queue, as the
        # relay does in (e), and each consuming attempt finds exactly N messages waiting.
        a = Figure("a", "pika publish, confirms, window 500 (SelectConnection)", "raw")
        b = Figure("b", "pika consume + ack per 250, prefetch 500", "raw")
        best_a: tuple[float, Timer] | None = None
        best_b: tuple[float, Timer] | None = None
        for _ in range(self.raw_repeats):
            timer = raw_publish_window(
                params, self.raw_exchange, "raw.window", self.wires, WINDOW, self.timeout
            )
            a.samples.append(round(n / timer.seconds, 1))
            if best_a is None or timer.seconds < best_a[0]:
                best_a = (timer.seconds, timer)
            depth = self.queue_depth(self.raw_queue)
            if depth != n:
                raise BenchError(f"raw queue holds {depth} messages, expected {n}")
            timer = raw_consume(params, self.raw_queue, n, self.timeout)
            b.samples.append(round(n / timer.seconds, 1))
            if best_b is None or timer.seconds < best_b[0]:
                best_b = (timer.seconds, timer)
        assert best_a is not None and best_b is not None
        self.record(a.took(n, best_a[1]))
        sent, timer = raw_publish_sync(
            params, self.raw_exchange, "raw.sync", self.wires, SYNC_CONFIRM_SECONDS
        )
        self.purge(self.raw_sync_queue)
        self.record(
            Figure(
                "a'",
                "pika publish, BlockingChannel confirm per message",
                "raw",
                note=f"once, time-boxed to {SYNC_CONFIRM_SECONDS:.0f} s",
            ).took(sent, timer)
        )
        self.record(b.took(n, best_b[1]))

    def raw_postgres(self) -> None:
        n = self.n
        rows = [from_wire(w) for w in self.wires]
        self.best_of(
            Figure("c", "psycopg insert inbox rows, 250 per INSERT + commit", "raw", "rows/s"),
            lambda: (n, raw_batch_insert(self.conninfo, self.t("inbox"), rows)),
            before=lambda: self.sql(sql.SQL("TRUNCATE {}").format(self.t("inbox"))),
        )
        outbox_rows = [
            {
                "message_id": r["message_id"],
                "kind": EVENT,
                "exchange": EVENTS_EXCHANGE,
                "routing_key": r["routing_key"],
                "payload": r["payload"],
                "headers": {},
                "version": 1,
                "key": None,
                "priority": None,
                "expires_at": None,
                "correlation_id": r["correlation_id"],
                "causation_id": None,
            }
            for r in rows
        ]
        self.best_of(
            Figure(
                "c'", "psycopg insert outbox rows, 1 per INSERT, commit per 500", "raw", "rows/s"
            ),
            lambda: (n, raw_single_inserts(self.conninfo, self.t("outbox"), outbox_rows)),
            before=lambda: self.sql(sql.SQL("TRUNCATE {}").format(self.t("outbox"))),
        )
        self.sql(
            sql.SQL("CREATE TABLE {} AS SELECT * FROM {}").format(
                self.t("inbox_seed"), self.t("inbox")
            )
        )
        variants = (
            ("d", "claim 50 SKIP LOCKED + mark processed + commit", False, False),
            ("d'", "  the same + 1 INSERT per row (the handler's effect)", True, False),
            ("d''", "  the same + a SAVEPOINT around each INSERT", True, True),
        )
        for key, title, effect, savepoints in variants:

            def claim(effect: bool = effect, savepoints: bool = savepoints, key: str = key):
                done, timer = raw_claim(
                    self.conninfo,
                    self.t("inbox"),
                    self.t("effects") if effect else None,
                    savepoints,
                )
                if done != n:
                    raise BenchError(f"raw claim ({key}) processed {done} rows, expected {n}")
                return done, timer

            self.best_of(Figure(key, title, "raw", "rows/s"), claim, before=self.reseed_raw_inbox)

    def reseed_raw_inbox(self) -> None:
        self.sql(
            sql.SQL("TRUNCATE {}, {}").format(self.t("inbox"), self.t("effects")),
            sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                self.t("inbox"), self.t("inbox_seed")
            ),
        )
        self.vacuum(self.t("inbox"), self.t("effects"))

    # -- the library -----------------------------------------------------------------------

    def a_table(self, name: str) -> sql.Composed:
        return sql.Identifier(self.a.settings.schema, name)

    def b_table(self, name: str) -> sql.Composed:
        return sql.Identifier(self.b.settings.schema, name)

    def write_outbox(self, svc: Service, n: int) -> Timer:
        with Timer() as timer:
            for start in range(0, n, OUTBOX_TXN):
                with svc.session() as session, session.begin():
                    for i in range(start, min(n, start + OUTBOX_TXN)):
                        svc.outbox.publish(session, EVENT_NAME, payload(i))
        return timer

    def library_broker_layer(self) -> None:
        """(e') and (f'): the library's publisher and consumer classes without any database."""
        n = self.n
        wires = [
            dataclasses.replace(w, exchange=self.raw_exchange, routing_key="raw.window")
            for w in self.wires
        ]
        broker = RabbitMQBroker(self.mq_url)
        publisher = broker.publisher()
        try:
            with Timer() as timer:
                for start in range(0, n, WINDOW):
                    outcomes = publisher.publish_batch(
                        wires[start : start + WINDOW], window=WINDOW, timeout=30.0
                    )
                    bad = [o for o in outcomes if o is not PublishOutcome.CONFIRMED]
                    if bad:
                        raise BenchError(f"library publisher: {len(bad)} not confirmed: {bad[0]}")
        finally:
            publisher.close()
        self.record(
            Figure(
                "e'",
                "RabbitMQPublisher.publish_batch alone, batches of 500",
                "library",
                limit_of=("a",),
            ).took(n, timer)
        )
        consumer = broker.consumer(self.raw_queue, prefetch=PREFETCH)
        try:
            got = 0
            with Timer() as timer:
                deadline = time.monotonic() + self.timeout
                while got < n:
                    batch = consumer.fetch(INSERT_BATCH, 0.05)
                    if batch:
                        got += len(batch)
                        consumer.ack_through(max(d.tag for d in batch))
                    if time.monotonic() > deadline:
                        raise BenchError(f"library consumer: {got} of {n}")
        finally:
            consumer.close()
        self.record(
            Figure(
                "f'",
                "RabbitMQConsumer.fetch(250) + ack_through alone",
                "library",
                limit_of=("b",),
            ).took(n, timer)
        )

    def library_relay(self) -> None:
        n = self.n
        print("\nlibrary", flush=True)
        timer = self.write_outbox(self.a, n)
        self.record(
            Figure(
                "w",
                "outbox.publish(), 500 per business transaction",
                "library",
                limit_of=("c'",),
            ).took(n, timer)
        )
        self.vacuum(self.a_table("outbox_messages"))
        relay = self.a.relay()
        with Timer() as timer:
            self.threads.start("relay", relay.run)
            wait_until(lambda: relay.published >= n, self.timeout, "relay", self.threads)
        self.threads.stop_all()
        self.record(
            Figure(
                "e", "relay: outbox backlog -> broker (1 relay thread)", "library", limit_of=("a",)
            ).took(n, timer)
        )
        self.dump_profiles("e")
        depth = self.queue_depth(f"{self.b.name}.inbox")
        if depth != n:
            raise BenchError(f"{self.b.name}.inbox holds {depth} messages, expected {n}")

    def library_receiver(self) -> None:
        n = self.n
        receiver = self.b.receiver()
        with Timer() as timer:
            self.threads.start("receiver", receiver.run)
            wait_until(lambda: receiver.stored >= n, self.timeout, "receiver", self.threads)
        self.threads.stop_all()
        self.record(
            Figure(
                "f",
                "receiver: inbox queue -> inbox table (1 thread)",
                "library",
                limit_of=("b", "c"),
            ).took(n, timer)
        )
        self.dump_profiles("f")
        self.sql(
            sql.SQL("CREATE TABLE {} AS SELECT * FROM {}").format(
                self.t("b_inbox_seed"), self.b_table("inbox_messages")
            )
        )

    def library_worker(self, threads: int) -> None:
        n = self.n
        self.sql(
            sql.SQL("TRUNCATE {}, {}").format(
                self.b_table("inbox_messages"), self.b_table("bench_effects")
            ),
            sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                self.b_table("inbox_messages"), self.t("b_inbox_seed")
            ),
        )
        self.vacuum(self.b_table("inbox_messages"), self.b_table("bench_effects"))
        workers = [self.b.worker() for _ in range(threads)]
        with Timer() as timer:
            for k, worker in enumerate(workers):
                self.threads.start(f"worker-{k}", worker.run)
            wait_until(
                lambda: sum(w.processed for w in workers) >= n, self.timeout, "worker", self.threads
            )
        self.threads.stop_all()
        key = "g" if threads == 1 else f"g{threads}"
        self.record(
            Figure(
                key,
                f"worker: pending rows -> handler + processed ({threads} thread"
                f"{'s' if threads > 1 else ''})",
                "library",
                limit_of=("d",),
            ).took(n, timer)
        )
        self.dump_profiles(key)
        effects = self.scalar(
            sql.SQL("SELECT count(*) FROM {}").format(self.b_table("bench_effects"))
        )
        if effects != n:
            raise BenchError(f"worker: {effects} handler effects, expected {n}")

    def end_to_end(self) -> None:
        n = self.n
        if self.args.profile:
            print("  h    skipped under --profile: its roles run where cProfile cannot follow them")
            return
        self.sql(
            sql.SQL("TRUNCATE {}, {}, {}, {}").format(
                self.a_table("outbox_messages"),
                self.b_table("inbox_messages"),
                self.b_table("inbox_deliveries"),
                self.b_table("bench_effects"),
            )
        )
        self.write_outbox(self.a, n)
        self.vacuum(
            self.a_table("outbox_messages"),
            self.b_table("inbox_messages"),
            self.b_table("bench_effects"),
        )
        count = sql.SQL("SELECT count(*) FROM {}").format(self.b_table("bench_effects"))
        # B runs in a process of its own, as a separate service would; A runs in this one.
        ctx = multiprocessing.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(
            target=serve_b,
            args=(self.tag, self.db_url, self.mq_url, ready, stop),
            name="bench-service-b",
            daemon=True,
        )
        self.children.append((child, stop))
        child.start()
        if not ready.wait(60) or not child.is_alive():
            raise BenchError("service B did not start in its process")
        assert child.pid is not None
        print(f"  h    (backlog of {n} written; service B runs in process {child.pid})", flush=True)
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                done = 0
                with Timer(extra_pids=frozenset({child.pid})) as timer:
                    self.a.start()
                    deadline = time.monotonic() + self.timeout
                    while done < n:
                        time.sleep(0.05)
                        row = conn.execute(count).fetchone()
                        done = int(row[0]) if row else 0
                        if not child.is_alive():
                            raise BenchError("service B's process died")
                        if time.monotonic() > deadline:
                            raise BenchError(f"end to end: {done} of {n} after {self.timeout} s")
        finally:
            self.a.stop()
            self.stop_children()
        self.record(
            Figure(
                "h",
                "end to end: A outbox -> B handler (A, B: svc.start())",
                "library",
                limit_of=("a", "b", "c", "d"),
            ).took(n, timer)
        )

    def stop_children(self) -> None:
        for _child, stop in self.children:
            stop.set()
        for child, _stop in self.children:
            child.join(30)
            if child.is_alive():
                log.warning("service B's process did not stop; terminating it")
                child.terminate()
                child.join(10)
            if child.is_alive():
                child.kill()
                child.join(5)
        self.children = []

    # -- report ----------------------------------------------------------------------------

    def finish_figures(self) -> None:
        for figure in self.figures.values():
            limits = [self.figures[k].rate for k in figure.limit_of if k in self.figures]
            known = [r for r in limits if r]
            if known and len(known) == len(figure.limit_of):
                figure.limit = min(known)

    def print_table(self) -> None:
        self.finish_figures()
        header = (
            f"{'fig':<4} {'what':<56} {'rate':>8} {'unit':<6} {'raw limit':>17} {'ratio':>5} "
            f"{'us/msg':>6} {'py/srv/oth':>11}"
        )
        print(f"\n{'=' * len(header)}\n{self.n} messages per figure; one run, same servers\n")
        print(header)
        group = ""
        for f in self.figures.values():
            if f.group != group:
                group = f.group
                print(f"-- {group}")
            limit = ""
            if f.limit_of and f.limit:
                names = ",".join(f.limit_of)
                limit = (
                    f"{f'min({names})' if len(f.limit_of) > 1 else f'({names})'} {_fmt(f.limit)}"
                )
            ratio = f"{f.ratio:.2f}" if f.ratio is not None else ""
            cpu_us = f"{f.cpu_us:.0f}" if f.cpu_us is not None else ""
            cores = "/".join(
                f"{v:.1f}" if v is not None else "?"
                for v in (f.client_cores, f.server_cores, f.other_cores)
            )
            print(
                f"{f.key:<4} {f.title:<56} {_fmt(f.rate):>8} {f.unit:<6} {limit:>17} {ratio:>5} "
                f"{cpu_us:>6} {cores:>11}"
            )
        print(
            "\nus/msg = CPU microseconds of the bench's own processes per message."
            "\npy/srv/oth = CPU cores busy during the figure: the bench's processes / the servers"
            f" it started / everything else on the machine ({os.cpu_count()} CPUs). A large 'oth'"
            " means a busy machine: the rates are then low and noisy."
        )
        stages = [self.figures[k].rate for k in ("e", "f", "g") if k in self.figures]
        h = self.figures.get("h")
        if h and h.rate and len(stages) == 3 and all(stages):
            slowest = min(r for r in stages if r)
            print(
                f"(h) / min(e, f, g) = {h.rate / slowest:.2f}: the slowest stage alone "
                f"would allow {_fmt(slowest)} msg/s."
            )
        g, d2 = self.figures.get("g"), self.figures.get("d''")
        if g and d2 and g.rate and d2.rate:
            print(
                f"(g) / (d'') = {g.rate / d2.rate:.2f}: the worker against the same SQL by hand "
                "(claim, one INSERT in a SAVEPOINT per message, mark)."
            )
        low = [f.key for f in self.figures.values() if f.ratio is not None and f.ratio < 0.3]
        if low:
            print(f"below 0.3 of the raw limit: {', '.join(low)} (see bench/README.md, profiling)")

    def write_json(self, path: str) -> None:
        self.finish_figures()
        data = {
            "messages": self.n,
            "finished_at": datetime.now(UTC).isoformat(),
            "environment": self.environment,
            "figures": [f.as_dict() for f in self.figures.values()],
        }
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {path}")

    # -- cleanup ---------------------------------------------------------------------------

    def cleanup(self) -> None:
        self.threads.stop_all()
        self.stop_children()
        for svc in self.services:
            with contextlib.suppress(Exception):
                svc.close()
        if self.external:
            self._drop_external()
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):
                server.cleanup()

    def _drop_external(self) -> None:
        """Remove what the bench made on servers it did not start."""
        if self.args.db_url and self.conninfo:
            with contextlib.suppress(Exception):
                schemas = [self.raw_schema] + [s.settings.schema for s in self.services]
                self.sql(
                    *(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(s))
                        for s in schemas
                    )
                )
        if self.args.mq_url and self.params is not None:
            with contextlib.suppress(Exception):
                connection = pika.BlockingConnection(self.params)
                try:
                    channel = connection.channel()
                    queues = [self.raw_queue, self.raw_sync_queue]
                    for svc in self.services:
                        queues += [q.name for q in svc.topology().queues if svc.name in q.name]
                    for queue in queues:
                        channel.queue_delete(queue)
                    channel.exchange_delete(self.raw_exchange)
                finally:
                    connection.close()

    # -- all -------------------------------------------------------------------------------

    def run(self) -> None:
        self.setup()
        self.warm_up()
        self.raw_rabbitmq()
        self.raw_postgres()
        print("\nlibrary broker layer (no database)", flush=True)
        self.library_broker_layer()
        self.library_relay()
        self.library_receiver()
        self.library_worker(1)
        self.library_worker(2)
        self.end_to_end()


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _fmt(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages per figure")
    parser.add_argument("--db-url", help="PostgreSQL URL of a database to use (default: start one)")
    parser.add_argument("--mq-url", help="amqp:// URL of a RabbitMQ to use (default: start one)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--phase-timeout", type=float, default=180.0, help="give up on a phase after this (s)"
    )
    parser.add_argument(
        "--raw-repeats",
        type=int,
        default=2,
        help="measure each raw limit this many times and keep the best (default 2)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run the library roles under cProfile, print the top functions and write DIR/*.prof"
        " (slows them down: the figures of such a run are not comparable)",
    )
    args = parser.parse_args(argv)
    if args.messages < WINDOW:
        parser.error(f"--messages must be at least {WINDOW}")
    if args.raw_repeats < 1:
        parser.error("--raw-repeats must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    bench = Bench(args)
    status = 0
    started = time.monotonic()
    with _interrupt_on_sigterm():
        try:
            bench.run()
        except KeyboardInterrupt:
            print("\ninterrupted; cleaning up", file=sys.stderr)
            status = 130
        except BenchError as exc:
            print(f"\nbenchmark failed: {exc}", file=sys.stderr)
            status = 1
        finally:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let cleanup finish
            try:
                bench.cleanup()
            finally:
                signal.signal(signal.SIGINT, previous)
    if bench.figures:
        bench.print_table()
        if args.json:
            bench.write_json(args.json)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
