"""The asyncio side: the outbox write (wa) and the worker (ga, ga2) on psycopg's async driver.

(wa) is the workload of (w) through ``await outbox.publish_async(async_session, ...)``. (ga) and
(ga2) are the workload of the worker in threads (g, g2), with an ``async def`` handler that
awaits its insert, the workers being tasks of one event loop. Each is reported as a ratio to the
same raw limit as its sync twin, and to the twin itself."""

from __future__ import annotations

import asyncio
import threading

from psycopg import sql
from sqlalchemy import Table, insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from bench.context import Context
from bench.roles import check_effects, reload_b_inbox
from bench.timing import Figure, Timer, wait_until
from bench.wire import EVENT_NAME, OUTBOX_TXN, payload
from outbox_inbox import Message, Service
from outbox_inbox.aio import AsyncWorker, async_url


def write_outbox_async(ctx: Context) -> None:
    """(wa): N awaited outbox.publish_async() calls, OUTBOX_TXN per AsyncSession transaction."""
    n = ctx.n
    svc = ctx.a

    async def write() -> None:
        engine = create_async_engine(async_url(ctx.db_url))
        sessions = async_sessionmaker(engine)
        try:
            for start in range(0, n, OUTBOX_TXN):
                async with sessions() as session, session.begin():
                    for i in range(start, min(n, start + OUTBOX_TXN)):
                        await svc.outbox.publish_async(session, EVENT_NAME, payload(i))
        finally:
            await engine.dispose()

    with Timer() as timer:
        asyncio.run(write())
    ctx.record(
        Figure(
            "wa",
            "outbox.publish_async(), 500 per AsyncSession transaction",
            "library",
            limit_of=("c'",),
        ).took(n, timer)
    )
    # The rows are not relayed: A's outbox is left as (e) left it.
    ctx.sql(
        sql.SQL("DELETE FROM {} WHERE published_at IS NULL").format(ctx.a_table("outbox_messages"))
    )


def _service_b_async(ctx: Context) -> Service:
    """Service B again (same name, schema and inbox rows), its handler an ``async def``."""
    b = ctx.b
    svc = Service(b.name, db_url=ctx.db_url, mq_url=ctx.mq_url, schema=b.settings.schema)
    effects: Table = ctx.effects

    @svc.on_event(b.handlers.subscriptions[0].pattern)
    async def on_order_placed(message: Message, session: AsyncSession) -> None:
        await session.execute(
            insert(effects),
            {"message_id": message.message_id, "order_id": message.payload["order_id"]},
        )

    return svc


def asyncio_workers(ctx: Context, count: int) -> None:
    """(ga) / (ga2): `count` asyncio workers, tasks of one event loop in one thread."""
    n = ctx.n
    reload_b_inbox(ctx)
    svc = _service_b_async(ctx)
    workers = [svc.async_worker() for _ in range(count)]

    def loop(stop: threading.Event) -> None:
        async def main() -> None:
            await asyncio.gather(*(w.run(stop) for w in workers))
            for worker in workers:
                await worker.close()

        asyncio.run(main())

    try:
        with Timer() as timer:
            ctx.threads.start("asyncio-workers", loop)
            wait_until(lambda: _processed(workers) >= n, ctx.timeout, "asyncio worker", ctx.threads)
        ctx.threads.stop_all()
    finally:
        svc.close()
    key = "ga" if count == 1 else f"ga{count}"
    ctx.record(
        Figure(
            key,
            f"asyncio worker: the same, async handler ({count} task{'s' if count > 1 else ''})",
            "library",
            limit_of=("d",),
        ).took(n, timer)
    )
    check_effects(ctx, "asyncio worker")


def _processed(workers: list[AsyncWorker]) -> int:
    return sum(w.processed for w in workers)
