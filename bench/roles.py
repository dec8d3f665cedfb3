"""The library's roles, each alone and then together: the broker layer (e', f'), the outbox
write (w), the relay (e), the receiver (f), the worker in threads (g, g2) and in processes
(gp, gp2), and the whole pipeline (h)."""

from __future__ import annotations

import dataclasses
import os
import time

import psycopg
from psycopg import sql

from bench.context import Context
from bench.services import (
    HANDLERS,
    build_service_b,
    run_role,
    run_worker_processes,
    serve,
)
from bench.timing import BenchError, Figure, Timer, wait_until
from bench.wire import EVENT_NAME, INSERT_BATCH, OUTBOX_TXN, PREFETCH, WINDOW, payload
from outbox_inbox import Service
from outbox_inbox.broker import PublishOutcome
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.supervisor import available_cpus


def write_outbox(svc: Service, n: int) -> Timer:
    """N calls of outbox.publish(), OUTBOX_TXN per business transaction."""
    with Timer() as timer:
        for start in range(0, n, OUTBOX_TXN):
            with svc.session() as session, session.begin():
                for i in range(start, min(n, start + OUTBOX_TXN)):
                    svc.outbox.publish(session, EVENT_NAME, payload(i))
    return timer


def broker_layer(ctx: Context) -> None:
    """(e') and (f'): the library's publisher and consumer classes without any database."""
    n = ctx.n
    wires = [
        dataclasses.replace(w, exchange=ctx.raw_exchange, routing_key="raw.window")
        for w in ctx.wires
    ]
    broker = RabbitMQBroker(ctx.mq_url)
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
        broker.close()  # the publisher pool's connection
    ctx.record(
        Figure(
            "e'",
            "RabbitMQPublisher.publish_batch alone, batches of 500",
            "library",
            limit_of=("a",),
        ).took(n, timer)
    )
    consumer = broker.consumer(ctx.raw_queue, prefetch=PREFETCH)
    try:
        got = 0
        with Timer() as timer:
            deadline = time.monotonic() + ctx.timeout
            while got < n:
                batch = consumer.fetch(INSERT_BATCH, 0.05)
                if batch:
                    got += len(batch)
                    consumer.ack_through(max(d.tag for d in batch))
                if time.monotonic() > deadline:
                    raise BenchError(f"library consumer: {got} of {n}")
    finally:
        consumer.close()
    ctx.record(
        Figure(
            "f'",
            "RabbitMQConsumer.fetch(250) + ack_through alone",
            "library",
            limit_of=("b",),
        ).took(n, timer)
    )


def relay_threads(ctx: Context, threads: int = 2) -> None:
    """(e2): `threads` relays of A (its `relay_threads`) share the publisher pool on a backlog.

    Runs before (w)/(e): what it publishes is purged from B's inbox queue and A's outbox is
    emptied after it, so (e) and (f) find the tables and queue as without it.
    """
    n = ctx.n
    write_outbox(ctx.a, n)
    ctx.vacuum(ctx.a_table("outbox_messages"))
    relays = [ctx.a.relay() for _ in range(threads)]
    with Timer() as timer:
        for k, role in enumerate(relays):
            ctx.threads.start(f"relay-{k}", role.run)
        wait_until(
            lambda: sum(r.published for r in relays) >= n, ctx.timeout, "relays", ctx.threads
        )
    ctx.threads.stop_all()
    ctx.record(
        Figure(
            "e2",
            f"relay: outbox backlog -> broker ({threads} relay threads, pool)",
            "library",
            limit_of=("a",),
        ).took(n, timer)
    )
    print(f"       messages per relay thread: {', '.join(str(r.published) for r in relays)}")
    ctx.dump_profiles("e2")
    depth = ctx.queue_depth(f"{ctx.b.name}.inbox")
    if depth != n:
        raise BenchError(f"{ctx.b.name}.inbox holds {depth} messages, expected {n}")
    ctx.purge(f"{ctx.b.name}.inbox")
    ctx.sql(sql.SQL("TRUNCATE {}").format(ctx.a_table("outbox_messages")))


def relay(ctx: Context) -> None:
    """(w) fills A's outbox; (e) relays that backlog to B's inbox queue."""
    n = ctx.n
    timer = write_outbox(ctx.a, n)
    ctx.record(
        Figure(
            "w",
            "outbox.publish(), 500 per business transaction",
            "library",
            limit_of=("c'",),
        ).took(n, timer)
    )
    ctx.vacuum(ctx.a_table("outbox_messages"))
    role = ctx.a.relay()
    with Timer() as timer:
        ctx.threads.start("relay", role.run)
        wait_until(lambda: role.published >= n, ctx.timeout, "relay", ctx.threads)
    ctx.threads.stop_all()
    ctx.record(
        Figure(
            "e", "relay: outbox backlog -> broker (1 relay thread)", "library", limit_of=("a",)
        ).took(n, timer)
    )
    ctx.dump_profiles("e")
    depth = ctx.queue_depth(f"{ctx.b.name}.inbox")
    if depth != n:
        raise BenchError(f"{ctx.b.name}.inbox holds {depth} messages, expected {n}")


def receiver(ctx: Context) -> None:
    """(f) stores the messages (e) left in B's inbox queue; keeps the rows for (g)."""
    n = ctx.n
    role = ctx.b.receiver()
    with Timer() as timer:
        ctx.threads.start("receiver", role.run)
        wait_until(lambda: role.stored >= n, ctx.timeout, "receiver", ctx.threads)
    ctx.threads.stop_all()
    ctx.record(
        Figure(
            "f",
            "receiver: inbox queue -> inbox table (1 thread)",
            "library",
            limit_of=("b", "c"),
        ).took(n, timer)
    )
    ctx.dump_profiles("f")
    ctx.sql(
        sql.SQL("CREATE TABLE {} AS SELECT * FROM {}").format(
            ctx.t("b_inbox_seed"), ctx.b_table("inbox_messages")
        )
    )


def reload_b_inbox(ctx: Context) -> None:
    """B's inbox holds the N pending rows (f) stored, and its handler's table is empty."""
    ctx.sql(
        sql.SQL("TRUNCATE {}, {}").format(
            ctx.b_table("inbox_messages"), ctx.b_table("bench_effects")
        ),
        sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
            ctx.b_table("inbox_messages"), ctx.t("b_inbox_seed")
        ),
    )
    ctx.vacuum(ctx.b_table("inbox_messages"), ctx.b_table("bench_effects"))


def check_effects(ctx: Context, what: str) -> None:
    effects = ctx.scalar(sql.SQL("SELECT count(*) FROM {}").format(ctx.b_table("bench_effects")))
    if effects != ctx.n:
        raise BenchError(f"{what}: {effects} handler effects, expected {ctx.n}")


#: The single-thread worker figures: (key, handler style, what it is compared with).
WORKER_FIGURES = (
    ("g", "execute", ("d'",)),
    ("g0", "noop", ("d",)),
    ("go", "orm", ("pq50",)),
    ("gw", "write", ("d'",)),
    ("gb", "batch", ("d",)),
)


def worker_threads(ctx: Context, threads: int, style: str = "execute") -> None:
    """(g) / (g2): `threads` workers in threads of the bench's process; (g0, go, gw, gb): one
    worker whose handler writes its row the way `style` says (services.HANDLERS)."""
    n = ctx.n
    reload_b_inbox(ctx)
    svc = (
        ctx.b if style == "execute" else build_service_b(ctx.tag, ctx.db_url, ctx.mq_url, style)[0]
    )
    workers = [svc.worker() for _ in range(threads)]
    with Timer() as timer:
        for k, worker in enumerate(workers):
            ctx.threads.start(f"worker-{k}", worker.run)
        wait_until(
            lambda: sum(w.processed for w in workers) >= n, ctx.timeout, "worker", ctx.threads
        )
    ctx.threads.stop_all()
    if svc is not ctx.b:
        svc.close()
    if threads > 1:
        key, limit_of = f"g{threads}", ("d'",)
        title = f"worker: pending rows -> handler + processed ({threads} threads)"
    else:
        key, _, limit_of = next(f for f in WORKER_FIGURES if f[1] == style)
        title = f"worker, 1 thread: {HANDLERS[style]}"
    ctx.record(Figure(key, title, "library", limit_of=limit_of).took(n, timer))
    ctx.dump_profiles(key)
    if style != "noop":
        check_effects(ctx, f"worker ({style})")


def worker_processes(ctx: Context, processes: int) -> None:
    """(gp) / (gp2): `processes` spawned processes, each running service B's worker().run.

    The clock starts once every process has imported the library and connected, and stops
    when their committed counts add up to N.
    """
    n = ctx.n
    key = "gp" if processes == 1 else f"gp{processes}"
    if ctx.profile:
        ctx.skipped(key, "under --profile (its worker runs where cProfile cannot follow it)")
        return
    reload_b_inbox(ctx)
    go = ctx.spawn.Event()
    progress = [ctx.spawn.Value("q", 0) for _ in range(processes)]
    children = [
        ctx.start_child(
            f"worker-{k}", run_role, "worker", ctx.tag, ctx.db_url, ctx.mq_url, go, progress[k]
        )
        for k in range(processes)
    ]
    pids = ctx.wait_ready(children, "worker processes")
    try:
        with Timer(extra_pids=pids) as timer:
            go.set()
            deadline = time.monotonic() + ctx.timeout
            while sum(p.value for p in progress) < n:
                time.sleep(0.005)
                if not all(child.is_alive() for child, _ in children):
                    raise BenchError("a worker process died")
                if time.monotonic() > deadline:
                    done = sum(p.value for p in progress)
                    raise BenchError(f"worker processes: {done} of {n} after {ctx.timeout} s")
    finally:
        ctx.stop_children()
    ctx.record(
        Figure(
            key,
            f"worker: the same in {processes} process{'es' if processes > 1 else ''}"
            " (spawned, 1 worker each)",
            "library",
            limit_of=("d",),
        ).took(n, timer)
    )
    check_effects(ctx, f"{processes} worker processes")


def worker_run(ctx: Context) -> None:
    """(gr): `svc.run_worker()` with its default settings in a process of its own, as
    ``outbox-inbox run worker`` runs it: one worker process per CPU, forked and supervised.

    The workers start on an empty inbox; the clock starts when the N rows appear in it (one
    INSERT ... SELECT, committed) and stops when their N effects are counted.
    """
    n = ctx.n
    if ctx.profile:
        ctx.skipped("gr", "under --profile (its workers run where cProfile cannot follow them)")
        return
    ctx.sql(
        sql.SQL("TRUNCATE {}, {}").format(
            ctx.b_table("inbox_messages"), ctx.b_table("bench_effects")
        )
    )
    child, ready = ctx.start_child(
        "worker-processes", run_worker_processes, ctx.tag, ctx.db_url, ctx.mq_url, daemon=False
    )
    pids = ctx.wait_ready([(child, ready)], "service B's run_worker()")
    cpus = available_cpus()
    wait_until(
        lambda: len(children_of(child.pid)) >= cpus, ctx.timeout, "worker processes", ctx.threads
    )
    time.sleep(1.0)  # they connect and go to sleep on LISTEN
    count = sql.SQL("SELECT count(*) FROM {}").format(ctx.b_table("bench_effects"))
    try:
        with Timer(extra_pids=pids) as timer:
            ctx.sql(
                sql.SQL("INSERT INTO {} SELECT * FROM {}").format(
                    ctx.b_table("inbox_messages"), ctx.t("b_inbox_seed")
                )
            )
            deadline = time.monotonic() + ctx.timeout
            while (ctx.scalar(count) or 0) < n:
                time.sleep(0.005)
                if not child.is_alive():
                    raise BenchError("run_worker()'s process died")
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"run_worker(): {ctx.scalar(count)} of {n} after {ctx.timeout} s"
                    )
    finally:
        ctx.stop_children()
    ctx.record(
        Figure(
            "gr",
            f"run_worker(), default settings: {cpus} worker processes",
            "library",
            limit_of=("d'",),
        ).took(n, timer)
    )
    check_effects(ctx, "run_worker()")


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    raw = f.read()
            except OSError:
                continue
            if int(raw[raw.rfind(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def wait_serving(ctx: Context, pid: int, processes: int | None = None) -> None:
    """Until the `svc.run(processes=processes)` in process `pid` (service B) consumes its inbox
    queue and its worker processes run (none of its own with one process)."""
    forked = 0 if processes == 1 else processes or available_cpus()
    wait_until(
        lambda: ctx.queue_consumers(f"{ctx.b.name}.inbox") >= 1 and len(children_of(pid)) >= forked,
        ctx.timeout,
        "service B to serve",
        ctx.threads,
    )
    time.sleep(0.5)  # its workers connect and go to sleep on LISTEN


def end_to_end(ctx: Context) -> None:
    """(h): A's outbox to B's handler, A in the bench's process and B in a child process."""
    n = ctx.n
    if ctx.profile:
        ctx.skipped("h", "under --profile (its roles run where cProfile cannot follow them)")
        return
    ctx.sql(
        sql.SQL("TRUNCATE {}, {}, {}, {}").format(
            ctx.a_table("outbox_messages"),
            ctx.b_table("inbox_messages"),
            ctx.b_table("inbox_deliveries"),
            ctx.b_table("bench_effects"),
        )
    )
    write_outbox(ctx.a, n)
    ctx.vacuum(
        ctx.a_table("outbox_messages"),
        ctx.b_table("inbox_messages"),
        ctx.b_table("bench_effects"),
    )
    count = sql.SQL("SELECT count(*) FROM {}").format(ctx.b_table("bench_effects"))
    # B runs svc.run() in a process of its own, as a separate service would: its relay and
    # receiver there, its workers in one process per CPU. A's relay runs in this one.
    child, ready = ctx.start_child(
        "service-b", serve, "b", ctx.tag, ctx.db_url, ctx.mq_url, None, daemon=False
    )
    pids = ctx.wait_ready([(child, ready)], "service B")
    wait_serving(ctx, child.pid)
    print(
        f"  h    (backlog of {n} written; service B runs svc.run() in process {child.pid})",
        flush=True,
    )
    try:
        with psycopg.connect(ctx.conninfo, autocommit=True) as conn:
            done = 0
            with Timer(extra_pids=pids) as timer:
                ctx.a.start()
                deadline = time.monotonic() + ctx.timeout
                while done < n:
                    time.sleep(0.05)
                    row = conn.execute(count).fetchone()
                    done = int(row[0]) if row else 0
                    if not child.is_alive():
                        raise BenchError("service B's process died")
                    if time.monotonic() > deadline:
                        raise BenchError(f"end to end: {done} of {n} after {ctx.timeout} s")
    finally:
        ctx.a.stop()
        ctx.stop_children()
    ctx.record(
        Figure(
            "h",
            "end to end: A outbox -> B handler (A: relay; B: svc.run())",
            "library",
            limit_of=("a", "b", "c", "d"),
        ).took(n, timer)
    )
