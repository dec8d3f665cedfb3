"""Fair claims and caps (group ``fair``): what fairness costs a no-op worker, what a cap that
never binds costs, and the latency of urgent commands sent while a bulk backlog drains.

Service F (schema ``bench_<id>_f``) handles its own commands; its inbox is seeded in SQL
(INSERT … SELECT generate_series), not through the broker. Each rate figure is the best of
``--raw-repeats`` runs after an untimed drain, the variants taken in turn, each repeat starting
with the next one, so that neither a cold first drain nor a busy moment of the machine falls
on one alone.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from psycopg import sql
from sqlalchemy import column, func, insert, select, table

from bench.context import Context
from bench.timing import Figure, Timer, wait_until
from bench.wire import PAYLOAD_SQL
from outbox_inbox import Message, Service

#: The bulk-and-urgent scenario: bulk items, the handler's time per bulk item (s), urgent
#: commands, and the gap between two of them (s), the first sent a second into the drain.
BULK, BULK_SECONDS, URGENT, URGENT_GAP = 4000, 0.003, 20, 0.1


def _service(ctx: Context, **settings: Any) -> Service:
    """Service F: ``noop.run`` (a no-op), ``bulk.item`` (sleeps `BULK_SECONDS`) and
    ``urgent.ping``, which notes ``clock_timestamp()`` in ``urgent_handled``."""
    cap, rate = settings.pop("cap", None), settings.pop("rate", None)
    schema = f"bench_{ctx.tag}_f"
    svc = Service(
        f"bench{ctx.tag}f", db_url=ctx.db_url, mq_url=ctx.mq_url, schema=schema, **settings
    )
    handled = table("urgent_handled", column("n"), column("at"), schema=schema)
    svc.on_command("noop.run", max_concurrency=cap, rate=rate)(lambda message, session: None)

    @svc.on_command("bulk.item")
    def bulk(message: Message, session: Any) -> None:
        time.sleep(BULK_SECONDS)

    @svc.on_command("urgent.ping")
    def urgent(message: Message, session: Any) -> None:
        session.execute(insert(handled).values(n=message.payload["n"], at=func.clock_timestamp()))

    svc.on_command("cap.run")(lambda message, session: None)  # run by _CAPPED's processes
    for command in ("split.run", "whole.run"):  # the order they are handled in, noted
        svc.on_command(command)(lambda message, session: served.append(message.type))
    svc.on_command("tenant.run")(lambda message, session: served.append(message.tenant))
    return svc


#: The types of the key-splitting scenario as they were handled, in order (threads append).
served: list[str] = []


def _seed(
    ctx: Context, svc: Service, command: str, rows: int, keys: int = 0, tenant: str = ""
) -> None:
    """F's inbox emptied, then `rows` pending `command` rows of `tenant` (over `keys` ordering
    keys, or none); with `keys` < 0 the rows are added to what is there."""
    inbox = sql.Identifier(svc.settings.schema, "inbox_messages")
    if keys >= 0:
        ctx.sql(sql.SQL("TRUNCATE {}").format(inbox))
    ctx.sql(
        sql.SQL(
            "INSERT INTO {} (message_id, source, kind, routing_key, payload, headers, tenant, key)"
            " SELECT gen_random_uuid(), %s, 'command', %s, {}, '{{}}'::jsonb, %s,"
            " CASE WHEN %s > 0 THEN 'k' || i %% %s END FROM generate_series(1, %s) AS i"
        ).format(inbox, sql.SQL(PAYLOAD_SQL)),
        params=(svc.name, f"{svc.name}.{command}", tenant, keys, max(keys, 1), rows),
    )
    ctx.vacuum(inbox)


def _drain(ctx: Context, svc: Service, threads: int = 1) -> Timer:
    workers = [svc.worker() for _ in range(threads)]
    total = ctx.n
    with Timer() as timer:
        for k, worker in enumerate(workers):
            ctx.threads.start(f"fair-worker-{k}", worker.run)
        wait_until(
            lambda: sum(w.processed for w in workers) >= total, ctx.timeout, "fair", ctx.threads
        )
    ctx.threads.stop_all()
    return timer


def noop_rates(ctx: Context) -> None:
    """(f0) fair claims, (f0x) fair_claims=False, (f0c) a cap of 1,000 and (f0r) a rate of a
    million a second that never bind: one worker thread, a no-op handler, N rows of one type."""
    variants = {
        "f0": ("worker, no-op, fair claims (default)", {}),
        "f0x": ("worker, no-op, fair_claims=False", {"fair_claims": False}),
        "f0c": ("worker, no-op, fair, max_concurrency=1000", {"cap": 1000}),
        "f0r": ("worker, no-op, fair, rate=(1000000, 1.0)", {"rate": (1_000_000, 1.0)}),
    }
    best: dict[str, Timer] = {}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    # The first drain of a run is slower (a cold server cache and plan cache): one untimed
    # drain first, and each repeat starts with the next variant, so none is always first.
    warm = _service(ctx)
    _seed(ctx, warm, "noop.run", ctx.n)
    _drain(ctx, warm)
    warm.close()
    keys = list(variants)
    for r in range(max(1, ctx.raw_repeats)):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            settings = variants[key][1]
            svc = _service(ctx, **dict(settings))
            _seed(ctx, svc, "noop.run", ctx.n)
            timer = _drain(ctx, svc)
            svc.close()
            samples[key].append(ctx.n / timer.seconds)
            if key not in best or timer.seconds < best[key].seconds:
                best[key] = timer
    for key, (title, _settings) in variants.items():
        figure = Figure(key, title, "library", samples=samples[key]).took(ctx.n, best[key])
        ctx.record(figure)


def urgent_latency(ctx: Context, fair: bool) -> dict[str, Any]:
    """`BULK` bulk items wait; a second into their drain by 2 worker threads, `URGENT` urgent
    pings are committed `URGENT_GAP` apart. Commit -> handled of the pings, in ms."""
    svc = _service(ctx, fair_claims=fair, worker_batch_size=50)
    handled_table = table("urgent_handled", column("n"), column("at"), schema=svc.settings.schema)
    ctx.sql(sql.SQL("TRUNCATE {}").format(sql.Identifier(svc.settings.schema, "urgent_handled")))
    _seed(ctx, svc, "bulk.item", BULK)
    workers = [svc.worker() for _ in range(2)]
    committed: dict[int, float] = {}

    def send() -> None:
        time.sleep(1.0)
        for n in range(URGENT):
            with svc.engine.begin() as conn:
                conn.execute(
                    svc.tables.inbox.insert().values(
                        message_id=uuid.uuid4(),
                        source=svc.name,
                        kind="command",
                        routing_key=f"{svc.name}.urgent.ping",
                        payload={"n": n},
                        headers={},
                    )
                )
            committed[n] = time.time()
            time.sleep(URGENT_GAP)

    began = time.monotonic()
    for k, worker in enumerate(workers):
        ctx.threads.start(f"urgent-worker-{k}", worker.run)
    sender = threading.Thread(target=send)
    sender.start()
    wait_until(
        lambda: sum(w.processed for w in workers) >= BULK + URGENT, ctx.timeout, "bulk", ctx.threads
    )
    drained = time.monotonic() - began
    sender.join()
    ctx.threads.stop_all()
    with svc.engine.connect() as conn:
        handled = dict(
            conn.execute(select(handled_table.c.n, func.extract("epoch", handled_table.c.at))).all()
        )
    svc.close()
    waits = sorted((float(handled[n]) - committed[n]) * 1000 for n in committed)
    result = {
        "fair_claims": fair,
        "p50_ms": statistics.median(waits),
        "p99_ms": statistics.quantiles(waits, n=100, method="inclusive")[98],
        "max_ms": waits[-1],
        "drain_s": drained,
    }
    print(
        f"  fu{'' if fair else 'x'}  urgent during a {BULK:,}-item drain, fair_claims={fair}:"
        f" commit -> handled p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms,"
        f" max {result['max_ms']:.0f} ms (drain {drained:.1f} s)",
        flush=True,
    )
    return result


def key_split_share(ctx: Context, by: str) -> dict[str, Any]:
    """Two groups wait, N/2 rows each, one spread over 100 ordering keys and one with none: by
    ``type``, ``split.run`` and ``whole.run``; by ``tenant``, the tenants ``split`` and
    ``whole`` of ``tenant.run``. 2 worker threads drain them. The split group's share of what
    was handled while both had work (fair: 0.5)."""
    svc = _service(ctx, worker_batch_size=50)
    half = max(ctx.n // 2, 100)
    if by == "type":
        split, whole = f"{svc.name}.split.run", f"{svc.name}.whole.run"
        _seed(ctx, svc, "split.run", half, keys=100)
        _seed(ctx, svc, "whole.run", half, keys=-1)
    else:
        split, whole = "split", "whole"
        _seed(ctx, svc, "tenant.run", half, keys=100, tenant=split)
        _seed(ctx, svc, "tenant.run", half, keys=-1, tenant=whole)
    served.clear()
    workers = [svc.worker() for _ in range(2)]
    for k, worker in enumerate(workers):
        ctx.threads.start(f"split-worker-{k}", worker.run)
    wait_until(lambda: len(served) >= 2 * half, ctx.timeout, "split", ctx.threads)
    ctx.threads.stop_all()
    svc.close()
    both = served[: min(_last(served, t) for t in (split, whole)) + 1]
    share = both.count(split) / len(both)
    print(
        f"  {'fk ' if by == 'type' else 'fkt'} a {by} over 100 keys against one with none:"
        f" its share while both wait {share:.2f}"
        f" (fair 0.50; {len(both):,} of {2 * half:,} handled then)",
        flush=True,
    )
    return {"split_share": share, "handled_while_both_wait": len(both), "total": 2 * half}


def _last(order: list[str], kind: str) -> int:
    """The position of the last `kind` in `order`: both types wait until the first of them
    has its last message handled."""
    return len(order) - 1 - order[::-1].index(kind)


#: One process of the cap scenario: 2 instances of service F (argv: db_url, schema, name,
#: cap), one worker thread each, handling ``cap.run`` (10 ms) under the cap, each call noting
#: how many calls ran at once in ``cap_gauge``; until stdin closes.
_CAPPED = """
import sys, threading, time
from sqlalchemy import create_engine, text
from outbox_inbox import Service

db_url, schema, name, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
gauge = create_engine(db_url, isolation_level="AUTOCOMMIT",
                      connect_args={"options": "-csearch_path=" + schema})
stop, threads = threading.Event(), []
for _ in range(2):
    svc = Service(name, db_url=db_url, schema=schema, worker_batch_size=10)

    @svc.on_command("cap.run", max_concurrency=cap)
    def run(message, session):
        with gauge.connect() as conn:
            conn.execute(text("UPDATE cap_gauge SET n = n + 1, top = greatest(top, n + 1)"))
            time.sleep(0.01)
            conn.execute(text("UPDATE cap_gauge SET n = n - 1"))

    threads.append(threading.Thread(target=svc.worker().run, args=(stop,)))
    threads[-1].start()
sys.stdin.read()
stop.set()
for thread in threads:
    thread.join(30)
"""


def cap_across_processes(ctx: Context, cap: int = 2, rows: int = 400) -> dict[str, Any]:
    """`rows` ``cap.run`` messages (10 ms each) under ``max_concurrency=cap``, handled by 2
    processes of 2 service instances each: the most calls the handlers saw at once."""
    svc = _service(ctx)
    schema = svc.settings.schema
    gauge = sql.Identifier(schema, "cap_gauge")
    ctx.sql(sql.SQL("DROP TABLE IF EXISTS {}").format(gauge))
    ctx.sql(sql.SQL("CREATE TABLE {} AS SELECT 0 AS n, 0 AS top").format(gauge))
    _seed(ctx, svc, "cap.run", rows)
    inbox = sql.Identifier(schema, "inbox_messages")
    left = sql.SQL("SELECT count(*) FROM {} WHERE status = 'pending'").format(inbox)
    argv = [sys.executable, "-c", _CAPPED, ctx.db_url, schema, svc.name, str(cap)]
    began = time.monotonic()
    children = [subprocess.Popen(argv, stdin=subprocess.PIPE) for _ in range(2)]
    try:
        wait_until(lambda: ctx.scalar(left) == 0, ctx.timeout, "cap", ctx.threads)
    finally:
        for child in children:
            child.communicate(timeout=60)  # closes stdin: the child stops its workers
    took = time.monotonic() - began
    top = ctx.scalar(sql.SQL("SELECT top FROM {}").format(gauge))
    svc.close()
    print(
        f"  fc  max_concurrency={cap} over 2 processes x 2 instances: at most {top} at once"
        f" ({rows} x 10 ms in {took:.1f} s, the cap allows {rows * 0.01 / cap:.1f} s)",
        flush=True,
    )
    return {"cap": cap, "most_at_once": top, "seconds": took, "rows": rows}


def measure(ctx: Context) -> None:
    svc = _service(ctx)
    ctx.services.append(svc)
    svc.migrate()
    handled = sql.Identifier(svc.settings.schema, "urgent_handled")
    ctx.sql(sql.SQL("CREATE TABLE {} (n int, at timestamptz)").format(handled))
    noop_rates(ctx)
    ctx.results["fair"] = [urgent_latency(ctx, fair) for fair in (True, False)]
    ctx.results["fair_split"] = key_split_share(ctx, "type")
    ctx.results["fair_split_tenant"] = key_split_share(ctx, "tenant")
    ctx.results["fair_cap"] = cap_across_processes(ctx)
