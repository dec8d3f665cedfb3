"""Peers: other libraries doing the same jobs on the same servers.

* pgqueuer (pq, pq50, pq', pqs): a PostgreSQL job queue. Its QueueManager drains N jobs from its
  own queue table, installed in a schema of the bench database with its own `Queries.install()`.
  (pq) runs no-op jobs with its defaults and its asyncpg driver, (pq50) with batches of 50, (pq')
  jobs that insert one row, (pqs) no-op jobs through its psycopg driver.
* dramatiq (dq, dq'): its RabbitMQ broker with publisher confirms enqueues N messages, the peer of
  the relay's publishing; then a dramatiq Worker (default settings, 8 threads) drains them.

Both are optional (``pip install '.[bench]'``): without them the figures are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from bench.context import Context
from bench.timing import BenchError, Figure, Timer, wait_until
from bench.wire import payload

PGQ_ENTRYPOINT = "bench"
PGQ_DEFAULT_BATCH = 10  # QueueManager.run's default batch_size
PGQ_MAX_SECONDS = 30.0  # a pgqueuer figure stops after this long if jobs are still queued
DRAMATIQ_THREADS = 8  # dramatiq.Worker's default worker_threads


@dataclass(frozen=True)
class PgqVariant:
    key: str
    title: str
    driver: str  # "asyncpg" or "psycopg"
    batch: int
    effect: bool  # the job inserts one row


PGQ_VARIANTS = (
    PgqVariant("pq", "pgqueuer {v}: drain N no-op jobs (asyncpg driver)", "asyncpg", 10, False),
    PgqVariant("pq50", "  the same, batch_size 50 (the worker's batch)", "asyncpg", 50, False),
    PgqVariant(
        "pq'", "  the same (batch 10), the job inserts 1 row (asyncpg pool)", "asyncpg", 10, True
    ),
    PgqVariant("pqs", "  no-op jobs, batch 10, its psycopg driver", "psycopg", 10, False),
)


def _pgq_settings(ctx: Context) -> Any:
    from pgqueuer.domain.settings import DBSettings
    from pgqueuer.types import Channel

    return DBSettings(db_schema=f"bench_{ctx.tag}_pgq", channel=Channel(f"bench_{ctx.tag}_pgq"))


def _pgq_queries(driver: Any, settings: Any) -> Any:
    """pgqueuer's Queries over `driver`, with every object name from `settings`."""
    from pgqueuer import Queries
    from pgqueuer.adapters.persistence.qb import (
        QueryBuilderEnvironment,
        QueryQueueBuilder,
        QuerySchedulerBuilder,
    )

    return Queries(
        driver,
        qbe=QueryBuilderEnvironment(settings),
        qbq=QueryQueueBuilder(settings),
        qbs=QuerySchedulerBuilder(settings),
    )


async def _pgq_install(conninfo: str, settings: Any) -> None:
    from pgqueuer import PsycopgDriver

    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        await _pgq_queries(PsycopgDriver(conn), settings).install()


async def _pgq_enqueue(conninfo: str, settings: Any, n: int) -> None:
    """N jobs whose payloads are the bench's messages (untimed)."""
    from pgqueuer import PsycopgDriver

    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        queries = _pgq_queries(PsycopgDriver(conn), settings)
        for start in range(0, n, 1000):
            k = min(1000, n - start)
            await queries.enqueue(
                [PGQ_ENTRYPOINT] * k,
                [json.dumps(payload(start + i)).encode() for i in range(k)],
                [0] * k,
            )


async def _pgq_drain(
    ctx: Context, settings: Any, variant: PgqVariant, effects: str
) -> tuple[int, Timer]:
    """Run a QueueManager in drain mode until its queue is empty (or PGQ_MAX_SECONDS passed);
    time it from the start of `run` to its end."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Job, PsycopgDriver, QueueManager
    from pgqueuer.types import Channel, QueueExecutionMode

    dsn = make_url(ctx.db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    async with contextlib.AsyncExitStack() as stack:
        if variant.driver == "asyncpg":
            conn = await asyncpg.connect(dsn)
            stack.push_async_callback(conn.close)
            driver: Any = AsyncpgDriver(conn)
        else:
            pconn = await psycopg.AsyncConnection.connect(ctx.conninfo, autocommit=True)
            stack.push_async_callback(pconn.close)
            driver = PsycopgDriver(pconn)
        pool = None
        if variant.effect:
            # One connection per job that may run at once: asyncpg connections run one query
            # at a time. Each INSERT commits by itself (pgqueuer has no transaction to join).
            pool = await asyncpg.create_pool(dsn, min_size=variant.batch, max_size=variant.batch)
            stack.push_async_callback(pool.close)
        insert = f"INSERT INTO {effects} (job_id, order_id) VALUES ($1, $2)"
        qm = QueueManager(_pgq_queries(driver, settings), channel=Channel(settings.channel))
        done = 0

        @qm.entrypoint(PGQ_ENTRYPOINT)
        async def job(job: Job) -> None:
            nonlocal done
            if pool is not None:
                order = json.loads(job.payload or b"{}")["order_id"]
                await pool.execute(insert, job.id, order)
            done += 1

        async def time_box() -> None:
            await asyncio.sleep(PGQ_MAX_SECONDS)
            qm.shutdown.set()

        box = asyncio.create_task(time_box())
        with Timer() as timer:
            await qm.run(batch_size=variant.batch, mode=QueueExecutionMode.drain)
        box.cancel()
    return done, timer


def pgqueuer(ctx: Context) -> None:
    """(pq), (pq50), (pq') and (pqs)."""
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        ctx.skipped("pq", "pgqueuer or asyncpg is not installed (pip install '.[bench]')")
        return
    n = ctx.n
    settings = _pgq_settings(ctx)
    ctx.extra_schemas.append(str(settings.db_schema))
    asyncio.run(_pgq_install(ctx.conninfo, settings))
    effects = ctx.t("pgq_effects")
    ctx.sql(
        sql.SQL(
            "CREATE TABLE {} (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, "
            "job_id bigint NOT NULL, order_id integer NOT NULL, "
            "handled_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(effects)
    )
    queue = sql.Identifier(str(settings.db_schema), settings.queue_table)
    for variant in PGQ_VARIANTS:
        ctx.sql(sql.SQL("TRUNCATE {}, {}").format(queue, effects))
        asyncio.run(_pgq_enqueue(ctx.conninfo, settings, n))
        ctx.vacuum(queue)
        done, timer = asyncio.run(_pgq_drain(ctx, settings, variant, effects.as_string(None)))
        if done < n and timer.seconds < PGQ_MAX_SECONDS:
            raise BenchError(f"pgqueuer ({variant.key}) ran {done} jobs, expected {n}")
        note = f"batch_size {variant.batch}, {variant.driver}"
        if done < n:
            note += f"; stopped after {PGQ_MAX_SECONDS:.0f} s"
        title = variant.title.format(v=version("pgqueuer"))
        ctx.record(Figure(variant.key, title, "peer", note=note).took(done, timer))


def dramatiq(ctx: Context) -> None:
    """(dq) and (dq')."""
    try:
        import dramatiq as dq
        from dramatiq.brokers.rabbitmq import RabbitmqBroker
        from dramatiq.common import dq_name, xq_name
    except ImportError:
        ctx.skipped("dq", "dramatiq is not installed (pip install '.[bench]')")
        return
    n = ctx.n
    queue = f"bench-{ctx.tag}-dramatiq"
    ctx.extra_queues += [queue, dq_name(queue), xq_name(queue)]
    broker = RabbitmqBroker(url=ctx.mq_url, confirm_delivery=True)
    done = 0
    lock = threading.Lock()

    def order_placed(order: dict[str, Any]) -> None:
        nonlocal done
        with lock:
            done += 1

    actor = dq.actor(broker=broker, queue_name=queue, actor_name=f"bench_{ctx.tag}")(order_placed)
    try:
        broker.declare_queue(queue, ensure=True)  # declared and connected before the clock
        with Timer() as timer:
            for i in range(n):
                actor.send(payload(i))
        ctx.record(
            Figure(
                "dq",
                f"dramatiq {version('dramatiq')}: actor.send(), RabbitMQ, confirm_delivery",
                "peer",
                limit_of=("a",),
            ).took(n, timer)
        )
        worker = dq.Worker(broker, worker_threads=DRAMATIQ_THREADS)
        try:
            with Timer() as timer:
                worker.start()
                wait_until(lambda: done >= n, ctx.timeout, "dramatiq worker", ctx.threads)
        finally:
            worker.stop()
        ctx.record(
            Figure(
                "dq'",
                f"  a dramatiq Worker ({DRAMATIQ_THREADS} threads) drains them, no-op actor",
                "peer",
                limit_of=("b",),
            ).took(n, timer)
        )
    finally:
        broker.close()
