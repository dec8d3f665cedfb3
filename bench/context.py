"""What every phase shares: the servers, connections, the bench's services, the figures measured
so far, its threads and child processes, and the cleanup of all of them."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import multiprocessing
import os
import platform
import pstats
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pika
import psycopg
import sqlalchemy
from psycopg import sql
from psycopg.sql import SQL, Composable, Composed
from sqlalchemy.engine import make_url

from bench.services import build_service_a, build_service_b, service_names
from bench.timing import BenchError, Figure, Threads, Timer, fmt, log
from bench.wire import EVENT_NAME, make_wires
from outbox_inbox import Service
from outbox_inbox.messages import EVENTS_EXCHANGE
from outbox_inbox.testing.servers import PostgresServer, RabbitMQServer

ROOT = Path(__file__).resolve().parent.parent
Statement = str | SQL | Composed


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


def git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class Context:
    """The state of one bench run. `setup()` starts or connects to the servers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.messages
        self.timeout: float = args.phase_timeout
        self.raw_repeats: int = args.raw_repeats
        self.profile = bool(args.profile)
        self.tag = uuid.uuid4().hex[:8]
        self.figures: dict[str, Figure] = {}
        self.results: dict[str, Any] = {}  # figures that are not rates: latency, memory
        self.threads = Threads()
        self.threads.profile = self.profile
        self.profile_dir: Path | None = Path(args.profile) if args.profile else None
        self.servers: list[PostgresServer | RabbitMQServer] = []
        self.children: list[tuple[Any, Any]] = []  # (process, stop event)
        self.services: list[Service] = []
        self.extra_schemas: list[str] = []  # made by peers; dropped on external servers
        self.extra_queues: list[str] = []
        self.external = False
        self.environment: dict[str, Any] = {}
        self.spawn = multiprocessing.get_context("spawn")
        # filled by setup()
        self.db_url = self.conninfo = self.mq_url = ""
        self.params: pika.URLParameters | None = None
        self.raw_schema = f"bench_{self.tag}_raw"
        self.raw_exchange = f"bench-{self.tag}-raw"
        self.raw_queue = f"bench-{self.tag}-raw"
        self.raw_sync_queue = f"bench-{self.tag}-raw-sync"

    # -- helpers ---------------------------------------------------------------------------

    def t(self, name: str) -> sql.Identifier:
        """A table of the raw schema."""
        return sql.Identifier(self.raw_schema, name)

    def a_table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.a.settings.schema, name)

    def b_table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.b.settings.schema, name)

    def sql(
        self,
        *statements: Statement,
        autocommit: bool = True,
        params: Sequence[Any] | None = None,
    ) -> None:
        with psycopg.connect(self.conninfo, autocommit=autocommit) as conn:
            for statement in statements:
                conn.execute(statement, params)

    def scalar(self, statement: Statement) -> Any:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute(statement).fetchone()
            return row[0] if row else None

    def vacuum(self, *tables: Composable) -> None:
        self.sql(*(sql.SQL("VACUUM ANALYZE {}").format(t) for t in tables))

    def channel_call(self, call: Callable[[Any], Any]) -> Any:
        """Run `call(channel)` on a fresh connection to the broker."""
        connection = pika.BlockingConnection(self.params)
        try:
            return call(connection.channel())
        finally:
            connection.close()

    def queue_depth(self, queue: str) -> int:
        result = self.channel_call(lambda ch: ch.queue_declare(queue, passive=True))
        return int(result.method.message_count)

    def queue_consumers(self, queue: str) -> int:
        result = self.channel_call(lambda ch: ch.queue_declare(queue, passive=True))
        return int(result.method.consumer_count)

    def purge(self, queue: str) -> None:
        self.channel_call(lambda ch: ch.queue_purge(queue))

    def record(self, figure: Figure) -> Figure:
        self.figures[figure.key] = figure
        samples = ""
        if figure.samples:
            samples = f"  best of {', '.join(fmt(r) for r in figure.samples)}"
        print(
            f"  {figure.key:<4} {figure.title:<58} "
            f"{fmt(figure.rate):>9} {figure.unit}  ({figure.count} in {figure.seconds:.2f} s)"
            + samples,
            flush=True,
        )
        return figure

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

    def skipped(self, key: str, why: str) -> None:
        print(f"  {key:<4} skipped: {why}", flush=True)

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

    # -- child processes -------------------------------------------------------------------

    def start_child(
        self, name: str, target: Callable[..., None], *args: Any, daemon: bool = True
    ) -> tuple[Any, Any]:
        """Start `target(*args, ready, stop)` in a spawned process; wait until it is ready.

        Returns (process, ready event); the stop event is kept for `stop_children()`. A child
        that forks processes of its own (`svc.run()`) must not be a daemon (`daemon=False`).
        """
        ready, stop = self.spawn.Event(), self.spawn.Event()
        child = self.spawn.Process(
            target=target, args=(*args, ready, stop), name=f"bench-{name}", daemon=daemon
        )
        self.children.append((child, stop))
        child.start()
        return child, ready

    def wait_ready(self, children: list[tuple[Any, Any]], what: str) -> frozenset[int]:
        """Wait until every (process, ready) is ready; return their pids."""
        deadline = time.monotonic() + 90
        for child, ready in children:
            while not ready.wait(0.2):
                if not child.is_alive():
                    raise BenchError(f"{what}: a child process died while starting")
                if time.monotonic() > deadline:
                    raise BenchError(f"{what}: child processes not ready after 90 s")
        return frozenset(child.pid for child, _ in children if child.pid is not None)

    def stop_children(self) -> None:
        for _child, stop in self.children:
            stop.set()
        for child, _stop in self.children:
            child.join(30)
            if child.is_alive():
                log.warning("child process %s did not stop; terminating it", child.name)
                child.terminate()
                child.join(10)
            if child.is_alive():
                child.kill()
                child.join(5)
        self.children = []

    # -- setup -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Start or reach the servers, build services A and B and the raw tables and queues."""
        self._connect_servers()
        a_name = self._build_services()
        mq_version = self._make_raw_objects()
        self._describe_environment(mq_version)
        self.wires = make_wires(self.n, a_name, EVENTS_EXCHANGE, f"{a_name}.{EVENT_NAME}")
        body = sum(len(w.body) for w in self.wires) / self.n
        self.environment["body_bytes"] = round(body, 1)
        env = self.environment
        print(
            f"\n{self.n} messages of {body:.0f} body bytes + {len(self.wires[0].headers)} headers;"
            f" PostgreSQL {env['postgresql']}, RabbitMQ {env['rabbitmq']}, {env['cpus']} CPUs\n",
            flush=True,
        )

    def _connect_servers(self) -> None:
        args = self.args
        if args.db_url:
            self.db_url = sqlalchemy_db_url(args.db_url)
            self.external = True
        else:
            print("starting PostgreSQL ...", flush=True)
            pg = PostgresServer()
            self.servers.append(pg)
            pg.start()
            self.db_url = pg.url("postgres")
        if args.mq_url:
            self.mq_url = args.mq_url
            self.external = True
        else:
            print("starting RabbitMQ ...", flush=True)
            mq = RabbitMQServer()
            self.servers.append(mq)
            mq.start()
            self.mq_url = mq.url
        self.conninfo = psycopg_conninfo(self.db_url)
        self.params = pika.URLParameters(self.mq_url)
        Timer.server_pids = frozenset(pid for server in self.servers for pid in server.pids)

    def _build_services(self) -> str:
        """Services A and B, migrated, their topology declared; returns A's name."""
        a_name, _ = service_names(self.tag)
        self.a = build_service_a(self.tag, self.db_url, self.mq_url)
        self.b, self.effects = build_service_b(self.tag, self.db_url, self.mq_url)
        self.services += [self.a, self.b]

        self.a.migrate()
        self.b.migrate()
        self.effects.create(self.b.engine)
        self.a.declare_topology()
        self.b.declare_topology()
        return a_name

    def _make_raw_objects(self) -> Any:
        """The raw figures' tables and queues, shaped like the library's; returns RabbitMQ's
        version as the broker reports it."""
        b_schema = self.b.settings.schema
        a_out = sql.Identifier(self.a.settings.schema, "outbox_messages")
        b_in = sql.Identifier(b_schema, "inbox_messages")
        self.sql(
            sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.raw_schema)),
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(self.t("inbox"), b_in),
            # A plain table (LIKE of the partitioned inbox), unique by message_id as the raw
            # insert's ON CONFLICT needs: the limit without partitions to keep ids unique across.
            sql.SQL("ALTER TABLE {} ADD UNIQUE (message_id)").format(self.t("inbox")),
            sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING ALL)").format(self.t("outbox"), a_out),
            # The same columns as the handler's table of service B (services.effects_table).
            sql.SQL(
                "CREATE TABLE {} (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
                "message_id uuid NOT NULL, order_id integer NOT NULL, "
                "handled_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(self.t("effects")),
        )

        def declare(channel: Any) -> Any:
            channel.exchange_declare(self.raw_exchange, "topic", durable=True)
            for queue, key in ((self.raw_queue, "raw.window"), (self.raw_sync_queue, "raw.sync")):
                channel.queue_declare(queue, durable=True)
                channel.queue_bind(queue, self.raw_exchange, key)
            server = channel.connection._impl.server_properties or {}
            return server.get("version", b"")

        return self.channel_call(declare)

    def _describe_environment(self, mq_version: Any) -> None:
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
            "run_tag": self.tag,  # in the names of its schemas, queues and exchange
            "library_commit": git("rev-parse", "--short", "HEAD"),
            "library_dirty": bool(git("status", "--porcelain", "--", "outbox_inbox")),
        }

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
            schemas = [self.raw_schema, *self.extra_schemas]
            schemas += [s.settings.schema for s in self.services]
            for schema in schemas:
                with contextlib.suppress(Exception):
                    self.sql(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                    )
        if self.args.mq_url and self.params is not None:
            queues = [self.raw_queue, self.raw_sync_queue, *self.extra_queues]
            for svc in self.services:
                with contextlib.suppress(Exception):
                    queues += [q.name for q in svc.topology().queues if svc.name in q.name]
            for queue in queues:
                with contextlib.suppress(Exception):
                    self.channel_call(functools.partial(_delete_queue, queue))
            with contextlib.suppress(Exception):
                self.channel_call(lambda ch: ch.exchange_delete(self.raw_exchange))


def _delete_queue(queue: str, channel: Any) -> None:
    channel.queue_delete(queue)
