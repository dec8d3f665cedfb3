"""Benchmark of the time-partitioned outbox and inbox (PostgreSQL), four groups of figures:

    .venv/bin/python bench/partitions.py [--rows 10000000] [--messages 20000] [--json FILE]

throughput  the relay, the receiver and the worker on empty tables, then with --rows finished
            rows in each table spread over a week of daily partitions; the claim's latency
size        table + index size during a sustained run with hour partitions and a short retention
retention   one partition of --retention-rows rows dropped by `partitions.maintain`, against
            DELETE of the same rows (one statement, and batches of 10,000)
start       a worker started on --pending-rows pending rows: time to its first handled message,
            its process's RSS over the first 30 s

It reuses bench/'s servers, services, timing and report (bench/README.md, "Partitions").
This is a benchmark, not a test: it only fails when a phase cannot finish.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # As bench/run.py: run as a script, Python puts bench/ first on the path; the package needs
    # the repository root instead.
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import functools
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine, event, text

from bench import report
from bench.cli import group_list, guarded
from bench.context import Context
from bench.latency import percentile
from bench.roles import write_outbox
from bench.rss import SAMPLE_EVERY, rss_mb, seed_inbox
from bench.services import (
    _child_logging,
    build_service_a,
    build_service_b,
    build_service_m,
    service_names,
)
from bench.timing import BenchError, Figure, Timer, fmt, wait_until
from bench.wire import EVENT_NAME, PAYLOAD_SQL, payload
from outbox_inbox import Service
from outbox_inbox.messages import EVENTS_EXCHANGE
from outbox_inbox.partitions import INTERVALS, Retention, floor_time, maintain, make_ahead
from outbox_inbox.retry import RetryPolicy

GROUPS = ("throughput", "size", "retention", "start")
THROUGHPUT_LEAST = 0.9  # full / empty, relay and worker
FIRST_HANDLED_MOST = 2.0  # seconds from start() to the first handled message
RSS_FLAT_MB = 10.0  # as bench/rss.py: the RSS's last quarter exceeds its first by less
WEEK = timedelta(days=7)
SIZE_PAST_HOURS = 6  # hour partitions in the past, filled with old rows, for maintain to drop
LATE_ROWS = 50  # unfinished rows in each past hour partition, due one after the other


# --- shared -------------------------------------------------------------------------------


def note(line: str) -> None:
    print(line, flush=True)


def rebuild_partitions(svc: Service, interval: str, past: timedelta) -> None:
    """Replace the migration's partitions (empty) by partitions from `past` before now to the
    usual ahead: drop them all, then `make_ahead` once with the old now and once with now."""
    tables = svc.tables
    with svc.engine.connect() as conn:
        for parent in ("outbox_messages", "inbox_messages"):
            rows = conn.execute(
                text(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = to_regclass(:parent)"
                ),
                {"parent": f"{tables.schema}.{parent}"},
            ).scalars()
            for name in list(rows):
                # Bench-made names of the library's own partitions, quoted by the dialect.
                quote = conn.dialect.identifier_preparer.quote
                conn.execute(text(f"DROP TABLE {quote(tables.schema)}.{quote(name)}"))
        conn.commit()
        now = datetime.now(UTC)
        make_ahead(conn, tables, interval, now - past)
        make_ahead(conn, tables, interval, now)


def seed_finished(
    ctx: Context,
    table: sql.Identifier,
    kind: str,
    rows: int,
    newest: datetime,
    span: timedelta,
    *,
    label: str,
    due: datetime | None = None,
) -> None:
    """`rows` rows of `kind` ('outbox' or 'inbox') in `table`, their times spread evenly over
    `span` before `newest` (newest first, so each partition is filled in one stretch), in one
    INSERT ... SELECT generate_series. Finished (published, processed), or with `due`
    unfinished (unsent, pending) and due then. `label`: routing key (and the inbox's source)."""
    step = span.total_seconds() / rows
    times = "%s::timestamptz - make_interval(secs => i * %s)"
    if kind == "outbox":
        done = "NULL" if due else "t + interval '50 milliseconds'"
        statement = sql.SQL(
            "INSERT INTO {} (message_id, kind, exchange, routing_key, payload, headers,"
            " correlation_id, created_at, available_at, published_at, attempts)"
            " SELECT m, 'event', %s, %s, {}, '{{}}'::jsonb, m::text, t, coalesce(%s, t), {},"
            " 1 FROM (SELECT gen_random_uuid() AS m, i, " + times + " AS t"
            " FROM generate_series(1, %s) AS i) AS s"
        ).format(table, sql.SQL(PAYLOAD_SQL), sql.SQL(done))
        params: tuple[Any, ...] = (EVENTS_EXCHANGE, label, due, newest, step, rows)
    else:
        status = "pending" if due else "processed"
        done = "NULL" if due else "t + interval '10 milliseconds'"
        statement = sql.SQL(
            "INSERT INTO {} (message_id, source, kind, routing_key, payload, headers,"
            " correlation_id, created_at, received_at, status, attempts, processed_at,"
            " next_attempt_at) SELECT m, %s, 'event', %s, {}, '{{}}'::jsonb, m::text, t, t,"
            " %s, %s, {}, coalesce(%s, t) FROM (SELECT gen_random_uuid() AS m, i, "
            + times
            + " AS t FROM generate_series(1, %s) AS i) AS s"
        ).format(table, sql.SQL(PAYLOAD_SQL), sql.SQL(done))
        params = (label, label, status, 0 if due else 1, due, newest, step, rows)
    ctx.sql(statement, params=params)


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def checkpoint(conn: psycopg.Connection[Any]) -> None:
    """CHECKPOINT, so that the next change of every page writes its full image to the WAL, as
    it does for rows a week old. Needs superuser (or pg_checkpoint): skipped without."""
    with suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


# --- 1. throughput on empty and on full tables -------------------------------------------


class ClaimTimes:
    """Wall time of each execution of the relay's and the worker's claim statements, read from
    SQLAlchemy's cursor events of every engine in this process."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"relay": [], "worker": []}
        self._started: dict[int, tuple[str, float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def role_of(statement: str) -> str | None:
        head = statement.lstrip()[:7].upper()
        # queries.roles._claim_outbox_statement and _claim_statement
        if "SKIP LOCKED" not in statement:
            return None
        if head.startswith("SELECT") and "outbox_messages" in statement:
            return "relay"
        if head.startswith("UPDATE") and "locked_by=" in statement:
            return "worker"
        return None

    def before(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        role = self.role_of(statement)
        if role is not None:
            self._started[id(cursor)] = (role, time.perf_counter())

    def after(self, conn: Any, cursor: Any, *_: Any) -> None:
        started = self._started.pop(id(cursor), None)
        if started is not None:
            with self._lock:
                self.times[started[0]].append(time.perf_counter() - started[1])

    @contextmanager
    def listening(self) -> Iterator[None]:
        event.listen(Engine, "before_cursor_execute", self.before)
        event.listen(Engine, "after_cursor_execute", self.after)
        try:
            yield
        finally:
            event.remove(Engine, "before_cursor_execute", self.before)
            event.remove(Engine, "after_cursor_execute", self.after)

    def drain(self) -> dict[str, list[float]]:
        """The seconds each claim took since the last drain, by role."""
        with self._lock:
            taken, self.times = self.times, {"relay": [], "worker": []}
        return taken


TITLES = {
    "relay": "relay: outbox backlog -> broker",
    "receiver": "receiver: inbox queue -> inbox table",
    "worker": "worker: pending rows -> handler + processed",
}
KEYS = {"relay": "E", "receiver": "F", "worker": "G"}


def measure_roles(
    ctx: Context, a: Service, b: Service, claims: ClaimTimes
) -> dict[str, tuple[int, Timer]]:
    """One round of (E), (F), (G) on the tables of services `a` and `b` as they are: N rows
    written by outbox.publish() into A's outbox, relayed to B's queue, stored by B's
    receiver, handled by B's worker (the session.execute handler of run.py's (g)); each role
    alone in a thread of this process, as run.py's."""
    n = ctx.n
    write_outbox(a, n)
    ctx.vacuum(sql.Identifier(a.settings.schema, "outbox_messages"))
    timers: dict[str, tuple[int, Timer]] = {}
    with claims.listening():
        for role_name, make, count in (
            ("relay", a.relay, "published"),
            ("receiver", b.receiver, "stored"),
            ("worker", b.worker, "processed"),
        ):
            if role_name == "worker":
                ctx.vacuum(sql.Identifier(b.settings.schema, "inbox_messages"))
            role: Any = make()

            def done(r: Any = role, c: str = count) -> bool:
                return int(getattr(r, c)) >= n

            with Timer() as timer:
                ctx.threads.start(role_name, role.run)
                wait_until(done, ctx.timeout, role_name, ctx.threads)
            ctx.threads.stop_all()
            timers[role_name] = (n, timer)
    return timers


def make_pair(ctx: Context, tag: str) -> tuple[Service, Service]:
    """Services A and B of run.py under another tag: B's handler writes to its effects table."""
    a = build_service_a(tag, ctx.db_url, ctx.mq_url)
    b, effects = build_service_b(tag, ctx.db_url, ctx.mq_url)
    ctx.services += [a, b]
    a.migrate()
    b.migrate()
    effects.create(b.engine)
    a.declare_topology()
    b.declare_topology()
    return a, b


def throughput(ctx: Context) -> None:
    """Two pairs of services A and B with the same daily partitions, one pair with empty
    tables and one with --rows finished rows in A's outbox and in B's inbox; rounds of the
    three roles alternate between the pairs, and each figure keeps its best round (a busy
    machine only slows a round)."""
    rows: int = ctx.args.rows
    rounds: int = ctx.args.rounds
    pairs = {"empty": make_pair(ctx, f"{ctx.tag}e"), "full": (ctx.a, ctx.b)}
    for a, b in pairs.values():
        rebuild_partitions(a, "day", timedelta(days=8))
        rebuild_partitions(b, "day", timedelta(days=8))
    began = time.monotonic()
    now = datetime.now(UTC)
    a_name, _ = service_names(ctx.tag)
    seed_finished(
        ctx, ctx.a_table("outbox_messages"), "outbox", rows, now, WEEK, label=f"{a_name}.seed"
    )
    filled_outbox = time.monotonic() - began
    seed_finished(
        ctx, ctx.b_table("inbox_messages"), "inbox", rows, now, WEEK, label=f"{a_name}.seed"
    )
    for a, b in pairs.values():
        ctx.sql(
            sql.SQL("ANALYZE {}").format(sql.Identifier(a.settings.schema, "outbox_messages")),
            sql.SQL("ANALYZE {}").format(sql.Identifier(b.settings.schema, "inbox_messages")),
        )
    filled = time.monotonic() - began
    note(
        f"  throughput: {rows:,} finished rows in the full pair's outbox ({filled_outbox:.0f} s)"
        f" and inbox, over the last 7 days of daily partitions (8 days back to 7 ahead),"
        f" analyzed ({filled:.0f} s in all); the empty pair has the same partitions"
    )
    claims = ClaimTimes()
    best: dict[str, tuple[int, Timer]] = {}
    samples: dict[str, list[float]] = {}
    latency: dict[str, dict[str, list[float]]] = {}
    for k in range(rounds):
        for phase, (a, b) in pairs.items():
            timers = measure_roles(ctx, a, b, claims)
            for role_name, (count, timer) in timers.items():
                key = f"{KEYS[role_name]}{'0' if phase == 'empty' else 'N'}"
                rate = count / timer.seconds
                samples.setdefault(key, []).append(round(rate, 1))
                if key not in best or rate > best[key][0] / best[key][1].seconds:
                    best[key] = (count, timer)
            for role_name, times in claims.drain().items():
                latency.setdefault(phase, {}).setdefault(role_name, []).extend(times)
            note(
                f"       round {k + 1} {phase:<5}: "
                + ", ".join(
                    f"{r} {fmt(c / t.seconds)}/s {t.client_cores * t.seconds / c * 1e6:.0f} us"
                    for r, (c, t) in timers.items()
                    if t.client_cores is not None
                )
            )
    for phase in pairs:
        for role_name in TITLES:
            key = f"{KEYS[role_name]}{'0' if phase == 'empty' else 'N'}"
            figure = Figure(
                key,
                f"{TITLES[role_name]}, {'empty' if phase == 'empty' else f'{rows:,} rows'}",
                "partitions",
                limit_of=(f"{KEYS[role_name]}0",) if phase == "full" else (),
                samples=samples[key],
            )
            ctx.record(figure.took(*best[key]))
    claim_latency = {
        phase: {role: claim_stats(times) for role, times in by_role.items()}
        for phase, by_role in latency.items()
    }
    ctx.results["throughput"] = {
        "rows": rows,
        "messages": ctx.n,
        "rounds": rounds,
        "fill_seconds": filled,
        "claim_latency": claim_latency,
        "table_bytes": {
            "full_outbox": table_bytes(ctx, ctx.a.settings.schema, "outbox_messages"),
            "full_inbox": table_bytes(ctx, ctx.b.settings.schema, "inbox_messages"),
        },
    }


def claim_stats(seconds: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000 for s in seconds)
    return {
        "claims": len(ms),
        "p50_ms": percentile(ms, 50) if ms else None,
        "p99_ms": percentile(ms, 99) if ms else None,
    }


def table_bytes(ctx: Context, schema: str, parent: str) -> int:
    """pg_total_relation_size summed over the partitions of `schema`.`parent`."""
    return int(
        ctx.scalar(
            sql.SQL(
                "SELECT coalesce(sum(pg_total_relation_size(inhrelid)), 0) FROM pg_inherits"
                " WHERE inhparent = {}::regclass"
            ).format(sql.Literal(f"{schema}.{parent}"))
        )
        or 0
    )


# --- 2. size under a sustained run with retention ------------------------------------------


def sizes(conn: psycopg.Connection[Any], schema: str, now: datetime) -> dict[str, Any]:
    """Bytes of the partitions (past: range ended before `now`; live: the others) of both
    tables, and of inbox_deliveries."""
    rows = conn.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), pg_total_relation_size(c.oid)"
        " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent IN (%s::regclass, %s::regclass)",
        (f"{schema}.outbox_messages", f"{schema}.inbox_messages"),
    ).fetchall()
    past = live = 0
    past_count = 0
    for _name, bound, size in rows:
        upper = bound.rsplit("TO ('", 1)[-1].split("'", 1)[0] if "TO ('" in bound else None
        if upper is not None and datetime.fromisoformat(upper).astimezone(UTC) <= now:
            past += int(size)
            past_count += 1
        else:
            live += int(size)
    row = conn.execute(
        "SELECT pg_total_relation_size(%s::regclass)", (f"{schema}.inbox_deliveries",)
    ).fetchone()
    deliveries = int(row[0]) if row else 0
    return {
        "past_bytes": past,
        "live_bytes": live,
        "deliveries_bytes": deliveries,
        "total_bytes": past + live + deliveries,
        "partitions": len(rows),
        "past_partitions": past_count,
    }


class Writer:
    """Writes `rate` messages per second through outbox.publish(), a transaction every 0.1 s,
    on a fixed schedule, until stopped."""

    def __init__(self, svc: Service, rate: float) -> None:
        self.svc = svc
        self.rate = rate
        self.written = 0
        self.late = 0.0

    def run(self, stop: threading.Event) -> None:
        start = time.perf_counter()
        tick = 0
        while not stop.is_set():
            tick += 1
            due = round(self.rate * tick * 0.1)
            with self.svc.session() as session, session.begin():
                for i in range(self.written, due):
                    self.svc.outbox.publish(session, EVENT_NAME, payload(i))
            self.written = due
            delay = start + tick * 0.1 - time.perf_counter()
            if delay > 0:
                stop.wait(delay)
            else:
                self.late = max(self.late, -delay)


def size(ctx: Context) -> None:
    minutes: float = ctx.args.minutes
    rate: float = ctx.args.rate
    retention: float = ctx.args.size_retention
    seconds = minutes * 60
    svc, effects = build_service_m(
        ctx.tag,
        ctx.db_url,
        ctx.mq_url,
        partition_interval="hour",
        retention=retention,
        dead_retention=retention,
        maintenance_interval=ctx.args.maintenance_interval,
        # The shortest duplicate window, so that a retention of a minute is allowed.
        receive_retry=RetryPolicy(max_attempts=1),
        relay_max_attempts=1,
        relay_retry_max=1.0,
    )
    ctx.services.append(svc)
    svc.migrate()
    effects.create(svc.engine)
    schema = svc.settings.schema
    rebuild_partitions(svc, "hour", timedelta(hours=SIZE_PAST_HOURS))
    # Old rows in the past hours: finished, and in each hour LATE_ROWS unfinished rows that
    # come due one hour after the other during the first 60 % of the run, so that maintain
    # drops a partition once its last rows are done (and keeps it until then).
    routing_key = f"{svc.name}.{EVENT_NAME}"
    hour = INTERVALS["hour"]
    top = floor_time(datetime.now(UTC), "hour")
    old_rows: int = ctx.args.size_rows
    start = datetime.now(UTC) + timedelta(seconds=20)
    for table, kind in (("outbox_messages", "outbox"), ("inbox_messages", "inbox")):
        seed_finished(
            ctx,
            sql.Identifier(schema, table),
            kind,
            old_rows,
            top,
            hour * SIZE_PAST_HOURS,
            label=routing_key,
        )
        for k in range(SIZE_PAST_HOURS):  # k = 0: the oldest hour
            newest = top - hour * (SIZE_PAST_HOURS - k) + hour / 2
            due = start + timedelta(seconds=seconds * 0.6 * k / SIZE_PAST_HOURS)
            seed_finished(
                ctx,
                sql.Identifier(schema, table),
                kind,
                LATE_ROWS,
                newest,
                timedelta(minutes=1),
                label=routing_key,
                due=due,
            )
    ctx.vacuum(sql.Identifier(schema, "outbox_messages"), sql.Identifier(schema, "inbox_messages"))
    note(
        f"  size: {old_rows:,} finished rows per table in the {SIZE_PAST_HOURS} past hours, and"
        f" {LATE_ROWS} unfinished rows in each hour due one after the other; retention"
        f" {retention:.0f} s, maintenance every {ctx.args.maintenance_interval:.0f} s;"
        f" {rate:,.0f} msg/s for {minutes:g} min"
    )
    writer = Writer(svc, rate)
    samples: list[dict[str, Any]] = []
    with psycopg.connect(ctx.conninfo, autocommit=True) as conn:
        t0 = time.monotonic()
        samples.append({"seconds": 0.0, "written": 0, **sizes(conn, schema, datetime.now(UTC))})
        with Timer() as timer:
            svc.start(relay=True, receiver=True, workers=1)
            try:
                ctx.threads.start("writer", writer.run)
                tick = 0
                while time.monotonic() - t0 < seconds:
                    tick += 1
                    time.sleep(max(0.0, t0 + tick * ctx.args.sample_every - time.monotonic()))
                    if ctx.threads.errors:
                        raise BenchError(f"size: {ctx.threads.errors[0]}")
                    sample = sizes(conn, schema, datetime.now(UTC))
                    sample.update(seconds=round(time.monotonic() - t0, 1), written=writer.written)
                    samples.append(sample)
            finally:
                ctx.threads.stop_all()
                svc.stop()
        handled = ctx.scalar(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "bench_effects"))
        )
    result = size_result(samples, rate, retention, ctx.args.maintenance_interval)
    result.update(
        rows_per_past_hour=old_rows / SIZE_PAST_HOURS,
        written=writer.written,
        handled=handled,
        writer_late_ms=writer.late * 1000,
        client_cores=timer.client_cores,
        server_cores=timer.server_cores,
        other_cores=timer.other_cores,
    )
    ctx.results["size"] = result
    print_size(result)


def _slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    return (
        statistics.linear_regression([p[0] for p in points], [p[1] for p in points]).slope
        * 60
        / 2**20
    )


def size_result(
    samples: list[dict[str, Any]], rate: float, retention: float, maintenance: float
) -> dict[str, Any]:
    """Sizes at the start, middle and end; slopes over the second half of the run (after the
    staggered drops) of each part; the bound the current partition reaches at this rate."""
    middle = samples[len(samples) // 2]
    half = samples[len(samples) // 2 :]
    slopes = {
        part: _slope_mb_per_min([(s["seconds"], s[f"{part}_bytes"]) for s in half])
        for part in ("total", "past", "live", "deliveries")
    }
    first, last = samples[0], samples[-1]
    grown = last["live_bytes"] - first["live_bytes"]
    per_message = grown / last["written"] if last["written"] else None
    # Each table keeps its rows for at most the interval + the retention + a maintenance
    # period before their partition is dropped: the size the live partitions reach, and stay
    # under, at this rate.
    bound = (
        per_message * rate * (3600 + retention + maintenance) if per_message is not None else None
    )
    return {
        "rate": rate,
        "retention_seconds": retention,
        "maintenance_interval": maintenance,
        "start": first,
        "middle": middle,
        "end": last,
        "slope_mb_per_min_second_half": slopes,
        "live_bytes_per_message": per_message,
        "live_bound_bytes": bound,
        "past_flat": last["past_bytes"] == 0 and last["past_partitions"] == 0,
        "deliveries_flat": abs(slopes["deliveries"]) < 1.0,
        "samples": samples,
    }


def print_size(r: dict[str, Any]) -> None:
    mb = 2**20
    for when in ("start", "middle", "end"):
        s = r[when]
        note(
            f"  size {when:<6} {s['seconds']:6.0f} s: total {s['total_bytes'] / mb:8.1f} MB ="
            f" past partitions {s['past_bytes'] / mb:7.1f} MB ({s['past_partitions']})"
            f" + live {s['live_bytes'] / mb:7.1f} MB + deliveries"
            f" {s['deliveries_bytes'] / mb:6.1f} MB; {s['partitions']} partitions,"
            f" {s['written']:,} written"
        )
    slopes = r["slope_mb_per_min_second_half"]
    note(
        "  size slope, second half: " + ", ".join(f"{k} {v:+.2f} MB/min" for k, v in slopes.items())
    )
    if r["live_bound_bytes"] is not None:
        note(
            f"  size: the live partitions grow {r['live_bytes_per_message']:.0f} bytes per"
            f" message (both tables); at {r['rate']:,.0f} msg/s they stay under"
            f" {r['live_bound_bytes'] / mb:,.0f} MB (an hour + retention + a maintenance period)"
        )


# --- 3. retention: drop a partition against DELETE -----------------------------------------


def retention(ctx: Context) -> None:
    rows: int = ctx.args.retention_rows
    name = f"bench-{ctx.tag}-r"
    svc = Service(name, db_url=ctx.db_url, mq_url=ctx.mq_url, schema=f"bench_{ctx.tag}_r")
    ctx.services.append(svc)
    svc.migrate()
    schema = svc.settings.schema
    rebuild_partitions(svc, "day", timedelta(days=9))
    day = floor_time(datetime.now(UTC), "day") - timedelta(days=9)
    part = f"inbox_messages_p{day:%Y%m%d}"
    inbox = sql.Identifier(schema, "inbox_messages")
    partition = sql.Identifier(schema, part)
    results: dict[str, Any] = {"rows": rows, "partition": part}

    def fill() -> None:
        seed_finished(
            ctx, inbox, "inbox", rows, day + timedelta(days=1), timedelta(days=1), label=name
        )
        ctx.sql(
            sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(partition),
            sql.SQL("VACUUM (FREEZE, ANALYZE) {}").format(partition),
        )

    # The runbook's statements (docs/runbook.md, before partitions), with its 7 days.
    where = "status = 'processed' AND processed_at < now() - interval '7 days'"
    one = sql.SQL("DELETE FROM {} WHERE " + where).format(inbox)
    batch = sql.SQL(
        "DELETE FROM {} WHERE id IN (SELECT id FROM {} WHERE " + where + " ORDER BY id LIMIT 10000)"
    ).format(inbox, inbox)
    with psycopg.connect(ctx.conninfo, autocommit=True) as conn:
        for method, statement in (("delete", one), ("delete_batched", batch)):
            fill()
            checkpoint(conn)
            lsn = wal_lsn(conn)
            t0 = time.perf_counter()
            deleted = 0
            while True:
                cur = conn.execute(statement)
                deleted += cur.rowcount
                if method == "delete" or cur.rowcount == 0:
                    break
            took = time.perf_counter() - t0
            wal = wal_since(conn, lsn)
            dead = dead_tuples(conn, schema, part, deleted)
            checkpoint(conn)
            lsn = wal_lsn(conn)
            t0 = time.perf_counter()
            conn.execute(sql.SQL("VACUUM {}").format(partition))
            vacuum = time.perf_counter() - t0
            results[method] = {
                "deleted": deleted,
                "seconds": took,
                "wal_bytes": wal,
                "dead_tuples": dead,
                "vacuum_seconds": vacuum,
                "vacuum_wal_bytes": wal_since(conn, lsn),
            }
            print_retention(method, results[method])
            if deleted != rows:
                raise BenchError(f"retention ({method}): deleted {deleted:,} of {rows:,} rows")
        fill()
        checkpoint(conn)
        lsn = wal_lsn(conn)
        t0 = time.perf_counter()
        done = maintain(
            svc.engine,
            svc.tables,
            interval="day",
            retention=Retention(finished=timedelta(days=8), dead=None),
        )
        took = time.perf_counter() - t0
        results["drop"] = {
            "dropped": done.dropped,
            "seconds": took,
            "wal_bytes": wal_since(conn, lsn),
            "dead_tuples": 0,
        }
        print_retention("drop", results["drop"])
        if part not in done.dropped:
            raise BenchError(f"retention: maintain dropped {done.dropped}, not {part}")
    ctx.results["retention"] = results


def dead_tuples(conn: psycopg.Connection[Any], schema: str, name: str, deleted: int) -> int:
    """n_dead_tup of the partition, once the statistics of the DELETE reached it: they are
    sent after the transactions end, within a second or so (waits for `deleted` or 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
            (schema, name),
        ).fetchone()
        value = int(row[0]) if row else 0
        if value >= deleted or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def print_retention(method: str, r: dict[str, Any]) -> None:
    vacuum = ""
    if "vacuum_seconds" in r:
        vacuum = (
            f"; then VACUUM {r['vacuum_seconds']:.2f} s, WAL {r['vacuum_wal_bytes'] / 2**20:.1f} MB"
        )
    note(
        f"  retention {method:<15} {r['seconds']:7.2f} s, WAL {r['wal_bytes'] / 2**20:8.1f} MB,"
        f" dead tuples {r['dead_tuples']:,}{vacuum}"
    )


# --- 4. a worker starting on a backlog -------------------------------------------------------


def start_worker(
    tag: str, db_url: str, mq_url: str, go: Any, started: Any, returned: Any, ready: Any, stop: Any
) -> None:
    """Child process: service B's `start(relay=False, receiver=False, workers=1)` at `go`;
    notes the epoch time of the call in `started` and of its return in `returned`."""
    _child_logging("start")
    svc, _ = build_service_b(tag, db_url, mq_url)
    try:
        ready.set()
        while not go.wait(0.05):
            if stop.is_set():
                return
        started.value = time.time()
        svc.start(relay=False, receiver=False, workers=1)
        returned.value = time.time()
        stop.wait()
    finally:
        svc.close()


def start(ctx: Context) -> None:
    rows: int = ctx.args.pending_rows
    seconds: float = ctx.args.start_seconds
    a_name, _ = service_names(ctx.tag)
    ctx.sql(
        sql.SQL("TRUNCATE {}, {}, {}").format(
            ctx.b_table("inbox_messages"),
            ctx.b_table("inbox_deliveries"),
            ctx.b_table("bench_effects"),
        )
    )
    seed_inbox(ctx, ctx.b.settings.schema, a_name, f"{a_name}.{EVENT_NAME}", rows)
    ctx.vacuum(ctx.b_table("inbox_messages"))
    note(f"  start: {rows:,} pending rows in B's inbox")
    go = ctx.spawn.Event()
    started, returned = ctx.spawn.Value("d", 0.0), ctx.spawn.Value("d", 0.0)
    child, ready = ctx.start_child(
        "start", start_worker, ctx.tag, ctx.db_url, ctx.mq_url, go, started, returned
    )
    ctx.wait_ready([(child, ready)], "the worker's process")
    assert child.pid is not None
    first = sql.SQL("SELECT extract(epoch FROM min(handled_at))::float8, count(*) FROM {}").format(
        ctx.b_table("bench_effects")
    )
    samples: list[tuple[float, float]] = []
    first_at: float | None = None
    try:
        with psycopg.connect(ctx.conninfo, autocommit=True) as conn:
            t0 = time.monotonic()
            go.set()
            tick = 0
            while True:
                elapsed = time.monotonic() - t0
                rss = rss_mb(child.pid)
                if rss is None or not child.is_alive():
                    raise BenchError("start: the worker's process died")
                samples.append((round(elapsed, 2), round(rss, 1)))
                if first_at is None:
                    row = conn.execute(first).fetchone()
                    if row and row[0] is not None:
                        first_at = float(row[0])
                if elapsed >= seconds:
                    break
                tick += 1
                time.sleep(max(0.0, t0 + tick * SAMPLE_EVERY - time.monotonic()))
            row = conn.execute(first).fetchone()
            handled = int(row[1]) if row else 0
    finally:
        ctx.stop_children()
    if first_at is None:
        raise BenchError(f"start: no message handled in {seconds:.0f} s")
    quarter = max(1, len(samples) // 4)
    head = statistics.median(s[1] for s in samples[:quarter])
    tail = statistics.median(s[1] for s in samples[-quarter:])
    result = {
        "pending_rows": rows,
        "first_handled_seconds": first_at - started.value,
        "start_returned_seconds": returned.value - started.value if returned.value else None,
        "handled_in_window": handled,
        "window_seconds": seconds,
        "rss_start_mb": samples[0][1],
        "rss_peak_mb": max(s[1] for s in samples),
        "rss_end_mb": samples[-1][1],
        "rss_drift_mb": tail - head,
        "rss_flat": tail - head < RSS_FLAT_MB,
        "samples": samples,
    }
    ctx.results["start"] = result
    note(
        f"  start: first message handled {result['first_handled_seconds']:.2f} s after start()"
        f" (start() returned after {result['start_returned_seconds'] or float('nan'):.2f} s);"
        f" {handled:,} handled in {seconds:.0f} s; RSS start {result['rss_start_mb']:.0f} MB,"
        f" peak {result['rss_peak_mb']:.0f} MB, end {result['rss_end_mb']:.0f} MB,"
        f" drift {result['rss_drift_mb']:+.1f} MB"
    )


# --- report ---------------------------------------------------------------------------------


def targets(ctx: Context) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for key, what in (("EN", "relay"), ("GN", "worker"), ("FN", "receiver")) if ctx.figures else ():
        f, empty = ctx.figures.get(key), ctx.figures.get(f"{key[0]}0")
        ratio = f.ratio if f else None
        least = THROUGHPUT_LEAST if what != "receiver" else None
        rows.append(
            {
                "what": f"{what} with {ctx.args.rows:,} rows / empty, best rounds",
                "ratio": ratio,
                "target": least,
                "met": None if ratio is None or least is None else ratio >= least,
            }
        )
        if f and empty and f.samples and empty.samples:
            # The median round of each: on a busy machine the best round is an outlier.
            median = statistics.median(f.samples) / statistics.median(empty.samples)
            rows.append(
                {
                    "what": f"{what} with {ctx.args.rows:,} rows / empty, median rounds",
                    "ratio": median,
                    "target": least,
                    "met": None if least is None else median >= least,
                }
            )
    s = ctx.results.get("start")
    if s:
        rows.append(
            {
                "what": "worker start -> first handled message (s)",
                "value": s["first_handled_seconds"],
                "target": f"<= {FIRST_HANDLED_MOST:g} s",
                "met": s["first_handled_seconds"] <= FIRST_HANDLED_MOST,
            }
        )
        rows.append(
            {
                "what": "worker RSS over the first 30 s, drift (MB)",
                "value": s["rss_drift_mb"],
                "target": "flat",
                "met": s["rss_flat"],
            }
        )
    z = ctx.results.get("size")
    if z:
        rows.append(
            {
                "what": "past partitions left at the end (MB)",
                "value": z["end"]["past_bytes"] / 2**20,
                "target": "0: all dropped",
                "met": z["past_flat"],
            }
        )
    return rows


def print_summary(ctx: Context) -> None:
    report.finish_figures(ctx)
    if ctx.figures:
        note(f"\n-- throughput, {ctx.n:,} messages per figure")
        note(f"{'fig':<4} {'what':<58} {'rate':>8} {'ratio':>5} {'us/msg':>6} {'py/srv/oth':>11}")
        for f in ctx.figures.values():
            cores = "/".join(
                f"{v:.1f}" if v is not None else "?"
                for v in (f.client_cores, f.server_cores, f.other_cores)
            )
            ratio = f"{f.ratio:.2f}" if f.ratio is not None else ""
            cpu = f"{f.cpu_us:.0f}" if f.cpu_us is not None else ""
            note(f"{f.key:<4} {f.title:<58} {fmt(f.rate):>8} {ratio:>5} {cpu:>6} {cores:>11}")
        t = ctx.results.get("throughput")
        if t:
            for phase, claims in t["claim_latency"].items():
                note(
                    f"claim latency, {phase:<5}: "
                    + "; ".join(
                        f"{role} p50 {c['p50_ms']:.2f} ms p99 {c['p99_ms']:.2f} ms"
                        for role, c in claims.items()
                    )
                )
    note("\n-- targets (printed, not asserted)")
    for row in targets(ctx):
        if "value" in row:
            measured, target = f"{row['value']:.2f}", row["target"]
        else:
            measured = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            target = f">= {row['target']:g}" if row["target"] is not None else ""
        met = "" if row["met"] is None else ("yes" if row["met"] else "NO")
        note(f"{row['what']:<50} {measured:>9} {target:>16} {met}")


# --- main -----------------------------------------------------------------------------------


def run(ctx: Context) -> None:
    only = set(ctx.args.only) or set(GROUPS)
    load = os.getloadavg()
    note(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    ctx.setup()
    ctx.environment["load_average_at_start"] = [round(v, 2) for v in load]
    if "throughput" in only:
        note("throughput")
        throughput(ctx)
    if "start" in only:
        note("\nstart")
        start(ctx)
    if "retention" in only:
        note("\nretention")
        retention(ctx)
    if "size" in only:
        note("\nsize")
        size(ctx)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="bench/partitions.py", description=doc.split("\n")[0])
    p.add_argument(
        "--rows", type=int, default=10_000_000, help="throughput: finished rows per table"
    )
    p.add_argument("--messages", type=int, default=20_000, help="throughput: messages per figure")
    p.add_argument("--rounds", type=int, default=3, help="throughput: rounds per pair (best kept)")
    p.add_argument("--minutes", type=float, default=3.0, help="size: length of the sustained run")
    p.add_argument("--rate", type=float, default=300.0, help="size: messages per second written")
    p.add_argument(
        "--size-rows", type=int, default=300_000, help="size: old rows per table in the past hours"
    )
    p.add_argument("--size-retention", type=float, default=60.0, help="size: retention (s)")
    p.add_argument(
        "--maintenance-interval", type=float, default=10.0, help="size: seconds between passes"
    )
    p.add_argument("--sample-every", type=float, default=5.0, help="size: seconds between samples")
    p.add_argument(
        "--retention-rows", type=int, default=1_000_000, help="retention: rows in the partition"
    )
    p.add_argument("--pending-rows", type=int, default=1_000_000, help="start: pending rows")
    p.add_argument("--start-seconds", type=float, default=30.0, help="start: RSS sampled this long")
    p.add_argument("--db-url", help="PostgreSQL URL of a database to use (default: start one)")
    p.add_argument("--mq-url", help="amqp:// URL of a RabbitMQ to use (default: start one)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--phase-timeout", type=float, default=600.0, help="give up on a phase (s)")
    p.add_argument(
        "--only",
        type=functools.partial(group_list, groups=GROUPS),
        action="extend",
        default=[],
        help=f"groups: {', '.join(GROUPS)}",
    )
    p.set_defaults(raw_repeats=1, profile=None, skip=[])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx = Context(args)
    began = time.monotonic()
    status = guarded(ctx, run)
    print_summary(ctx)
    if args.json:
        report.write_json(ctx, args.json, targets(ctx))
    note(f"\ntotal {time.monotonic() - began:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
