"""Commit -> handled latency at a steady offered load (L).

Writer threads in the bench's process commit one outbox row of service A per transaction, on
a fixed schedule (message i is due at start + i / rate; a late writer catches up at once, so the
offered load does not bend to the system's pace), and note `time.time()` right after each
commit, keyed by message id. Services A and B each run `svc.run()` in a child process of their
own, with their default settings, as users run them (the relay and receiver in that process,
the workers in one process per CPU), so the writers share the bench's interpreter with nothing
else. One run per offered rate (`--latency-rate`). B's handler inserts
its row with `clock_timestamp()`, the database server's clock on the same host.
Latency = handled - committed. The same load offered first for `--latency-warmup` seconds is
handled before the measured load begins and reported apart, as the pipeline's cold start.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from bench import raw_pipeline
from bench.context import Context
from bench.roles import wait_serving
from bench.services import build_service_a, serve
from bench.timing import BenchError, Timer, tree_cpu_seconds
from bench.wire import EVENT_NAME, payload


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted `values` (q in 0..100)."""
    if not values:
        return float("nan")
    rank = max(1, min(len(values), math.ceil(q / 100 * len(values))))
    return values[rank - 1]


#: The stages of a message's way, between the times the bench can see.
STAGES = {
    "commit -> relay claims it": ("committed", "published"),
    "relay claim -> receiver stores it": ("published", "received"),
    "receiver's insert -> handler runs": ("received", "handled"),
}


def epochs(ctx: Context, table: sql.Identifier, column: str) -> dict[uuid.UUID, float]:
    """message_id -> `column` of `table` as seconds since the epoch."""
    with psycopg.connect(ctx.conninfo) as conn:
        rows = conn.execute(
            sql.SQL("SELECT message_id, extract(epoch FROM {})::float8 FROM {}").format(
                sql.Identifier(column), table
            )
        ).fetchall()
    return {mid: float(at) for mid, at in rows if at is not None}


#: The pipelines L measures at each rate: services A and B as users run them, default settings
#: (L); the same with one process each, ``processes=1`` (L_p1: a default must never lose to
#: it); the same path written by hand with psycopg and pika (L_raw, bench/raw_pipeline.py).
PIPELINES = ("L", "L_p1", "L_raw")


def measure(ctx: Context) -> None:
    if ctx.profile:
        ctx.skipped("L", "under --profile (its roles run where cProfile cannot follow them)")
        return
    raw_pipeline.create(ctx, exist_ok=True)
    ctx.results["latency"] = [
        _measure_at(ctx, rate, pipeline) for rate in ctx.args.latency_rate for pipeline in PIPELINES
    ]


def _measure_at(ctx: Context, rate: float, pipeline: str) -> dict[str, Any]:
    raw = pipeline == "L_raw"
    load = _Load(ctx, rate, raw)
    tables = _tables(ctx, raw)
    ctx.sql(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(tables.values())))
    ctx.vacuum(*tables.values())
    if raw:
        ctx.purge(raw_pipeline.queue(ctx))
        children = raw_pipeline.start(ctx, raw_pipeline.cpus())
        pids = ctx.wait_ready(children, "the hand-written pipeline")
        what = f"the hand-written pipeline runs in processes {sorted(pids)}"
        trees = {child.name.removeprefix("bench-"): frozenset({child.pid}) for child, _ in children}
    else:
        processes = 1 if pipeline == "L_p1" else None
        b = ctx.start_child(
            "service-b", serve, "b", ctx.tag, ctx.db_url, ctx.mq_url, processes, daemon=False
        )
        a = ctx.start_child(
            "service-a", serve, "a", ctx.tag, ctx.db_url, ctx.mq_url, processes, daemon=False
        )
        children = [b, a]
        pids = ctx.wait_ready(children, "services A and B")
        wait_serving(ctx, b[0].pid, processes or None)
        what = (
            f"services A and B run svc.run(processes={processes}) in processes"
            f" {a[0].pid} and {b[0].pid}"
        )
        trees = {"A": frozenset({a[0].pid}), "B": frozenset({b[0].pid})}
    print(
        f"  {pipeline:<5} {load.rate:,.0f} msg/s offered for {load.seconds:.0f} s by"
        f" {load.writers} writer threads in {load.processes} processes; {what}",
        flush=True,
    )
    alive = [c for c, _ in children]
    # The cold start apart: the same load for --latency-warmup seconds first, handled before
    # the measured load begins, so that the figures are the pipeline's steady state.
    warm = (
        _Load(ctx, rate, raw, seconds=ctx.args.latency_warmup) if ctx.args.latency_warmup else None
    )
    try:
        if warm is not None:
            warm.run()
            _wait_handled(ctx, tables["handled"], warm.total, alive)
        warm_batches = _batches(ctx, tables)
        before = {name: tree_cpu_seconds(p) or 0.0 for name, p in trees.items()}
        with Timer(extra_pids=pids) as timer:
            written = load.run()
            _wait_handled(ctx, tables["handled"], (warm.total if warm else 0) + load.total, alive)
        spent = {name: (tree_cpu_seconds(p) or 0.0) - before[name] for name, p in trees.items()}
    finally:
        ctx.stop_children()
    columns = {"published": "published_at", "received": "received_at", "handled": "handled_at"}
    times = {stage: epochs(ctx, tables[stage], column) for stage, column in columns.items()}
    committed = load.committed
    ms = _latencies(committed, times["handled"])
    if len(ms) != load.total:
        raise BenchError(f"latency: {len(ms)} of {load.total} messages matched a commit time")
    result = _result(load, written, ms, _stages(committed, times), timer)
    result["pipeline"] = pipeline
    result["cold"] = _cold(warm, times["handled"]) if warm is not None else None
    batches = _batches(ctx, tables)
    result["batches"] = {role: n - warm_batches[role] for role, n in batches.items()}
    # Where the CPU went, per process (tree) of the pipeline; the rest is the writers'.
    result["cpu_us_by_process"] = {
        name: seconds / load.total * 1e6 for name, seconds in spent.items()
    }
    result["pipeline_cpu_us"] = sum(result["cpu_us_by_process"].values())
    _print_result(result)
    return result


def _latencies(committed: dict[uuid.UUID, float], handled: dict[uuid.UUID, float]) -> list[float]:
    """Handled - committed, in ms, sorted, of the messages in `committed`."""
    return sorted((at - committed[mid]) * 1000 for mid, at in handled.items() if mid in committed)


def _cold(warm: _Load, handled: dict[uuid.UUID, float]) -> dict[str, float]:
    """The warm-up's latency, the pipeline's cold start: its first message's, p99 and max."""
    ms = _latencies(warm.committed, handled)
    first = min(warm.committed, key=warm.committed.__getitem__)
    return {
        "seconds": warm.seconds,
        "first_ms": (handled[first] - warm.committed[first]) * 1000,
        "p99_ms": percentile(ms, 99),
        "max_ms": ms[-1],
    }


def _tables(ctx: Context, raw: bool) -> dict[str, sql.Identifier]:
    """The tables of each stage's times: the outbox (published), the inbox (received,
    processed) and the handler's effects (handled)."""
    if raw:
        t = raw_pipeline.tables(ctx)
        return {"published": t["outbox"], "received": t["inbox"], "handled": t["effects"]}
    return {
        "published": ctx.a_table("outbox_messages"),
        "received": ctx.b_table("inbox_messages"),
        "handled": ctx.b_table("bench_effects"),
        "deliveries": ctx.b_table("inbox_deliveries"),
    }


def _batches(ctx: Context, tables: dict[str, sql.Identifier]) -> dict[str, int]:
    """How many transactions each role needed for the load: the rows of one transaction share
    its start time (now()) in published_at, received_at and processed_at."""
    count = "SELECT count(DISTINCT {}) FROM {}"
    return {
        role: int(ctx.scalar(sql.SQL(count).format(sql.Identifier(column), tables[stage])) or 0)
        for role, column, stage in (
            ("relay", "published_at", "published"),
            ("receiver", "received_at", "received"),
            ("worker", "processed_at", "received"),
        )
    }


class _Load:
    """The writers and their shared schedule: message i is due at start + i / rate. The writers
    are threads of `--latency-writer-processes` processes of their own, so that the offered rate
    is not bound by one interpreter's lock."""

    def __init__(self, ctx: Context, rate: float, raw: bool, seconds: float | None = None) -> None:
        self.ctx = ctx
        self.rate = rate
        self.seconds: float = ctx.args.latency_seconds if seconds is None else seconds
        self.processes: int = ctx.args.latency_writer_processes
        self.writers: int = ctx.args.latency_writers * self.processes
        self.total = max(1, round(self.rate * self.seconds))
        self.committed: dict[uuid.UUID, float] = {}
        self.late: list[float] = []  # how far behind schedule each writer fell, at most
        # What a writer process needs to write: the hand-written pipeline's outbox (psycopg),
        # or service A's (its outbox.publish).
        self.spec: tuple[Any, ...] = (
            ("raw", ctx.conninfo, raw_pipeline.tables(ctx)["outbox"].as_string(None))
            if raw
            else ("library", ctx.tag, ctx.db_url, ctx.mq_url)
        )

    def run(self) -> float:
        """Offer the whole load; returns the seconds the writers took."""
        out = self.ctx.spawn.Queue()
        start_at = time.time() + 2.0  # the processes start meanwhile
        threads = self.ctx.args.latency_writers
        processes = [
            self.ctx.spawn.Process(
                target=_writer_process,
                args=(self.spec, p * threads, threads, self.writers, self.rate, self.total),
                kwargs={"start_at": start_at, "out": out},
                name=f"bench-writers-{p}",
            )
            for p in range(self.processes)
        ]
        for process in processes:
            process.start()
        errors: list[str] = []
        for _ in processes:
            committed, late, failed = out.get(timeout=self.seconds + 120)
            self.committed.update((uuid.UUID(m), at) for m, at in committed)
            self.late += late
            errors += failed
        for process in processes:
            process.join(30)
        written = max(self.committed.values(), default=start_at) - start_at
        if errors:
            raise BenchError(f"latency writer: {errors[0]}")
        return written


def _writer_process(
    spec: tuple[Any, ...],
    first: int,
    threads: int,
    writers: int,
    rate: float,
    total: int,
    *,
    start_at: float,
    out: Any,
) -> None:
    """Writers `first` .. `first + threads - 1` of `writers`, one thread each: writer w commits
    messages w, w + writers, ... each when due; puts (committed, late, errors) on `out`."""
    kind, *where = spec
    svc = build_service_a(*where) if kind == "library" else None
    start = time.perf_counter() + (start_at - time.time())
    committed: list[tuple[str, float]] = []
    late: list[float] = []
    errors: list[str] = []

    def write(w: int) -> None:
        worst = 0.0
        conn = psycopg.connect(where[0]) if svc is None else None
        try:
            for i in range(w, total, writers):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                else:
                    worst = max(worst, -delay)
                if conn is not None:
                    mid = raw_pipeline.write_one(conn, where[1], json.dumps(payload(i)))
                else:
                    assert svc is not None
                    with svc.engine.begin() as c:
                        mid = svc.outbox.publish(c, EVENT_NAME, payload(i))
                committed.append((str(mid), time.time()))
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            if conn is not None:
                conn.close()
        late.append(worst)

    pool = [threading.Thread(target=write, args=(first + j,)) for j in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if svc is not None:
        svc.close()
    out.put((committed, late, errors))


def _wait_handled(ctx: Context, effects: sql.Identifier, total: int, children: list[Any]) -> None:
    """Until the handler has written `total` rows (60 s at most after the last commit)."""
    count = sql.SQL("SELECT count(*) FROM {}").format(effects)
    deadline = time.monotonic() + 60
    while (ctx.scalar(count) or 0) < total:
        if not all(child.is_alive() for child in children):
            raise BenchError("a process of the pipeline died")
        if time.monotonic() > deadline:
            raise BenchError("latency: messages not handled 60 s after the last commit")
        time.sleep(0.05)


def _stages(
    committed: dict[uuid.UUID, float], times: dict[str, dict[uuid.UUID, float]]
) -> dict[str, dict[str, float]]:
    """Where the time goes: the relay's claim (published_at is its transaction's start), the
    receiver's insert (received_at, likewise), the handler (handled_at)."""
    starts = {"committed": committed, **times}
    stages = {}
    for name, (since, until) in STAGES.items():
        spans = sorted(
            (starts[until][mid] - starts[since][mid]) * 1000
            for mid in committed
            if mid in starts[since] and mid in starts[until]
        )
        stages[name] = {"p50_ms": percentile(spans, 50), "p99_ms": percentile(spans, 99)}
    return stages


def _result(
    load: _Load, written: float, ms: list[float], stages: dict[str, Any], timer: Timer
) -> dict[str, Any]:
    return {
        "offered_rate": load.rate,
        "achieved_rate": load.total / written if written > 0 else None,
        "seconds": load.seconds,
        "writers": load.writers,
        "messages": load.total,
        "writer_max_late_ms": max(load.late) * 1000 if load.late else None,
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": ms[-1],
        "mean_ms": statistics.fmean(ms),
        "stages": stages,
        "client_cores": timer.client_cores,
        "server_cores": timer.server_cores,
        "other_cores": timer.other_cores,
        # CPU of the bench's processes (writers, services A and B) per message
        "cpu_us": (timer.client_cores or 0) * timer.seconds / load.total * 1e6,
    }


def _print_result(result: dict[str, Any]) -> None:
    print(
        f"  {result['pipeline']:<5} commit -> handled: p50 {result['p50_ms']:.1f} ms,"
        f" p90 {result['p90_ms']:.1f} ms,"
        f" p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms"
        f" ({result['messages']} messages at {result['achieved_rate']:,.0f} msg/s;"
        f" writers at most {result['writer_max_late_ms']:.1f} ms late)",
        flush=True,
    )
    for name, stage in result["stages"].items():
        print(
            f"       {name:<36} p50 {stage['p50_ms']:8.1f} ms, p99 {stage['p99_ms']:8.1f} ms",
            flush=True,
        )
    batches = result["batches"]
    print(
        "       transactions: "
        + ", ".join(
            f"{role} {n:,} ({result['messages'] / n:.1f} msg each)" if n else f"{role} 0"
            for role, n in batches.items()
        )
        + f"; CPU {result['cpu_us']:.0f} us/msg, {result['pipeline_cpu_us']:.0f} of it the"
        + " pipeline's ("
        + ", ".join(f"{k} {v:.0f}" for k, v in result["cpu_us_by_process"].items())
        + "), the rest the writers'",
        flush=True,
    )
    if cold := result["cold"]:
        print(f"       {cold_text(cold)}", flush=True)


def cold_text(cold: dict[str, float]) -> str:
    """The line of a pipeline's cold start (`_cold`)."""
    return (
        f"cold start, the {cold['seconds']:g} s before (left out): first message"
        f" {cold['first_ms']:.1f} ms, p99 {cold['p99_ms']:.1f} ms, max {cold['max_ms']:.1f} ms"
    )
