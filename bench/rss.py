"""Resident memory (RSS) of a relay process and of a worker process over a large backlog (M).

The backlog is seeded in SQL (INSERT … SELECT generate_series), not through the library: service
M's outbox for the relay, then its inbox for the worker. Each role runs alone in a spawned
process (`services.run_role`); the bench reads the process's RSS from /proc every 0.5 s while it
works, until the backlog is done or `--memory-seconds` have passed. The relay's messages go to a
queue capped at 10,000 messages (RabbitMQ drops the oldest), so the broker does not hold the
whole backlog.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from psycopg import sql

from bench.context import Context
from bench.services import build_service_m, run_role
from bench.timing import BenchError
from bench.wire import EVENT_NAME, PAYLOAD_SQL
from outbox_inbox.messages import EVENTS_EXCHANGE

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_EVERY = 0.5  # seconds
CAPPED_QUEUE_LENGTH = 10_000
FLAT_MB = 10.0  # "flat": the median RSS of the last quarter of the run exceeds the first's by less


def rss_mb(pid: int) -> float | None:
    """Resident set size of process `pid` in MiB (Linux /proc/PID/statm)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE / 2**20
    except (OSError, ValueError, IndexError):
        return None


def seed_outbox(ctx: Context, schema: str, routing_key: str, rows: int) -> None:
    ctx.sql(
        sql.SQL(
            "INSERT INTO {} (message_id, kind, exchange, routing_key, payload, headers,"
            " correlation_id) SELECT m, 'event', %s, %s, {}, '{{}}'::jsonb, m::text"
            " FROM (SELECT gen_random_uuid() AS m, i FROM generate_series(1, %s) AS i) AS s"
        ).format(sql.Identifier(schema, "outbox_messages"), sql.SQL(PAYLOAD_SQL)),
        params=(EVENTS_EXCHANGE, routing_key, rows),
    )


def seed_inbox(ctx: Context, schema: str, source: str, routing_key: str, rows: int) -> None:
    ctx.sql(
        sql.SQL(
            "INSERT INTO {} (message_id, source, kind, routing_key, payload, headers,"
            " correlation_id, created_at) SELECT m, %s, 'event', %s, {}, '{{}}'::jsonb, m::text,"
            " now() FROM (SELECT gen_random_uuid() AS m, i FROM generate_series(1, %s) AS i) AS s"
        ).format(sql.Identifier(schema, "inbox_messages"), sql.SQL(PAYLOAD_SQL)),
        params=(source, routing_key, rows),
    )


def watch(ctx: Context, role: str, rows: int, seconds: float) -> dict[str, Any]:
    """Run `role` in a child process over the backlog; sample its RSS every 0.5 s."""
    go = ctx.spawn.Event()
    progress = ctx.spawn.Value("q", 0)
    child, ready = ctx.start_child(
        role, run_role, role, ctx.tag, ctx.db_url, ctx.mq_url, go, progress
    )
    ctx.wait_ready([(child, ready)], role)
    assert child.pid is not None
    samples: list[tuple[float, float, int]] = []  # (seconds, RSS MiB, rows done)
    start = time.monotonic()
    go.set()
    try:
        tick = 0
        while True:
            elapsed = time.monotonic() - start
            rss, done = rss_mb(child.pid), int(progress.value)
            if rss is None or not child.is_alive():
                raise BenchError(f"{role}: the process died")
            samples.append((round(elapsed, 2), round(rss, 1), done))
            if done >= rows or (seconds > 0 and elapsed >= seconds):
                break
            if elapsed > ctx.timeout and seconds <= 0 and done == 0:
                raise BenchError(f"{role}: nothing done after {ctx.timeout:.0f} s")
            tick += 1
            time.sleep(max(0.0, start + tick * SAMPLE_EVERY - time.monotonic()))
    finally:
        ctx.stop_children()
    working = [s for s in samples if s[2] > 0] or samples
    quarter = max(1, len(working) // 4)
    first = statistics.median(s[1] for s in working[:quarter])
    last = statistics.median(s[1] for s in working[-quarter:])
    elapsed, _, done = samples[-1]
    return {
        "role": role.removeprefix("memory-"),
        "backlog": rows,
        "done": done,
        "seconds": elapsed,
        "rate": done / elapsed if elapsed > 0 else None,
        "idle_mb": samples[0][1],
        "max_mb": max(s[1] for s in samples),
        "final_mb": samples[-1][1],
        "drift_mb": last - first,
        "flat": last - first < FLAT_MB,
        "samples": samples,
    }


def measure(ctx: Context) -> None:
    if ctx.profile:
        ctx.skipped("M", "under --profile (its roles run where cProfile cannot follow them)")
        return
    rows: int = ctx.args.memory_rows
    seconds: float = ctx.args.memory_seconds
    svc, effects = build_service_m(ctx.tag, ctx.db_url, ctx.mq_url)
    ctx.services.append(svc)
    svc.migrate()
    effects.create(svc.engine)
    schema = svc.settings.schema
    routing_key = f"{svc.name}.{EVENT_NAME}"
    capped = f"bench-{ctx.tag}-memory"
    ctx.extra_queues.append(capped)

    def declare(channel: Any) -> None:
        channel.queue_declare(capped, durable=True, arguments={"x-max-length": CAPPED_QUEUE_LENGTH})
        channel.queue_bind(capped, EVENTS_EXCHANGE, routing_key)

    ctx.channel_call(declare)
    limit = f"for at most {seconds:.0f} s" if seconds > 0 else "until it is done"
    results = []
    for role, table in (("memory-relay", "outbox_messages"), ("memory-worker", "inbox_messages")):
        began = time.monotonic()
        if role == "memory-relay":
            seed_outbox(ctx, schema, routing_key, rows)
        else:
            seed_inbox(ctx, schema, svc.name, routing_key, rows)
        ctx.vacuum(sql.Identifier(schema, table))
        print(
            f"  M    {rows:,} rows seeded in {time.monotonic() - began:.0f} s;"
            f" the {role.removeprefix('memory-')} process works through them {limit}",
            flush=True,
        )
        result = watch(ctx, role, rows, seconds)
        results.append(result)
        print(
            f"  M    {result['role']}: {result['done']:,} rows in {result['seconds']:.0f} s"
            f" ({result['rate']:,.0f}/s); RSS idle {result['idle_mb']:.0f} MB,"
            f" max {result['max_mb']:.0f} MB, final {result['final_mb']:.0f} MB,"
            f" drift {result['drift_mb']:+.1f} MB",
            flush=True,
        )
        ctx.sql(sql.SQL("TRUNCATE {}").format(sql.Identifier(schema, table)))
    ctx.results["memory"] = results
