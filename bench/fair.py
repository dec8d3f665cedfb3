"""Fair claims and caps (group ``fair``): what fairness costs a no-op worker, what a cap that
never binds costs, and the latency of urgent commands sent while a bulk backlog drains.

Service F (schema ``bench_<id>_f``) handles its own commands; its inbox is seeded in SQL
(INSERT … SELECT generate_series), not through the broker. Each rate figure is the best of
``--raw-repeats`` runs, the variants taken in turn so that a busy moment of the machine falls
on each alike.
"""

from __future__ import annotations

import statistics
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
    cap = settings.pop("cap", None)
    schema = f"bench_{ctx.tag}_f"
    svc = Service(
        f"bench{ctx.tag}f", db_url=ctx.db_url, mq_url=ctx.mq_url, schema=schema, **settings
    )
    handled = table("urgent_handled", column("n"), column("at"), schema=schema)
    svc.on_command("noop.run", max_concurrency=cap)(lambda message, session: None)

    @svc.on_command("bulk.item")
    def bulk(message: Message, session: Any) -> None:
        time.sleep(BULK_SECONDS)

    @svc.on_command("urgent.ping")
    def urgent(message: Message, session: Any) -> None:
        session.execute(insert(handled).values(n=message.payload["n"], at=func.clock_timestamp()))

    return svc


def _seed(ctx: Context, svc: Service, command: str, rows: int) -> None:
    """F's inbox emptied, then `rows` pending `command` rows."""
    inbox = sql.Identifier(svc.settings.schema, "inbox_messages")
    ctx.sql(sql.SQL("TRUNCATE {}").format(inbox))
    ctx.sql(
        sql.SQL(
            "INSERT INTO {} (message_id, source, kind, routing_key, payload, headers)"
            " SELECT gen_random_uuid(), %s, 'command', %s, {}, '{{}}'::jsonb"
            " FROM generate_series(1, %s) AS i"
        ).format(inbox, sql.SQL(PAYLOAD_SQL)),
        params=(svc.name, f"{svc.name}.{command}", rows),
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
    """(f0) fair claims, (f0x) fair_claims=False, (f0c) a cap of 1,000 that never binds: one
    worker thread, a no-op handler, N rows of one type."""
    variants = {
        "f0": ("worker, no-op, fair claims (default)", {}),
        "f0x": ("worker, no-op, fair_claims=False", {"fair_claims": False}),
        "f0c": ("worker, no-op, fair, max_concurrency=1000", {"cap": 1000}),
    }
    best: dict[str, Timer] = {}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(max(1, ctx.raw_repeats)):
        for key, (_title, settings) in variants.items():
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


def measure(ctx: Context) -> None:
    svc = _service(ctx)
    ctx.services.append(svc)
    svc.migrate()
    handled = sql.Identifier(svc.settings.schema, "urgent_handled")
    ctx.sql(sql.SQL("CREATE TABLE {} (n int, at timestamptz)").format(handled))
    noop_rates(ctx)
    ctx.results["fair"] = [urgent_latency(ctx, fair) for fair in (True, False)]
