"""Async outbox writes and the roles in an event loop, on the real servers.

`publish_async` / `send_async` write in the caller's AsyncSession or AsyncConnection (psycopg's
async driver) and never commit it; they check what the sync writes check, take the per-key
writer lock, keep the trace context, and their commit wakes the relay by NOTIFY. A service
mixing sync and async handlers runs both from `start()` (threads) and from `run_async()` (tasks),
and cancelling `run_async` lets the batch in hand commit before it returns.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session

from helpers import make_service, rows, scalar, wait_until
from outbox_inbox import Message, MessageError, PayloadTooLarge, Service
from outbox_inbox.aio import async_url

OUTBOX = "outbox_inbox.outbox_messages"
INBOX = "outbox_inbox.inbox_messages"


def _count(db_url: str, table: str = OUTBOX) -> int:
    return int(scalar(db_url, f"SELECT count(*) FROM {table}"))


def test_publish_async_and_send_async_commit_only_with_the_callers_transaction(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None)

    async def scenario() -> tuple[Any, Any]:
        engine = create_async_engine(async_url(db_url))
        sessions = async_sessionmaker(engine)
        try:
            async with sessions() as session, session.begin():
                await session.execute(
                    text("INSERT INTO effects (message_id, type) VALUES ('biz', 'order')")
                )
                event_id = await svc.outbox.publish_async(
                    session, "order.placed", {"id": 1}, key="order-1"
                )
                command_id = await svc.outbox.send_async(
                    session, "billing", "invoice.create", {"order": 1}
                )
                assert session.in_transaction()
                # Nothing is visible to others before the caller commits.
                assert _count(db_url) == 0
            # Rolled back: nothing, on a session and on a connection alike.
            async with sessions() as session, session.begin():
                await svc.outbox.publish_async(session, "order.placed", {"id": 2})
                await session.rollback()
            async with engine.connect() as conn:
                await svc.outbox.send_async(conn, "billing", "invoice.create", {})
                assert conn.in_transaction()
            # Closed without commit: discarded.
            session = sessions()
            await svc.outbox.publish_async(session, "order.placed", {"id": 3})
            await session.close()
            return event_id, command_id
        finally:
            await engine.dispose()

    event_id, command_id = asyncio.run(scenario())
    found = rows(
        db_url,
        f"SELECT message_id, kind, routing_key, key, correlation_id FROM {OUTBOX} ORDER BY id",
    )
    assert [tuple(r) for r in found] == [
        (event_id, "event", "orders.order.placed", "order-1", str(event_id)),
        (command_id, "command", "billing.invoice.create", None, str(command_id)),
    ]
    assert _count(db_url, "effects") == 1
    svc.close()


def test_async_writes_refuse_bad_messages_and_the_wrong_session_kind_and_the_transaction_survives(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None, max_payload_bytes=100)

    async def scenario() -> None:
        engine = create_async_engine(async_url(db_url))
        try:
            async with AsyncSession(engine) as session, session.begin():
                with pytest.raises(PayloadTooLarge):
                    await svc.outbox.publish_async(session, "order.placed", {"blob": "x" * 200})
                with pytest.raises(MessageError, match="JSON"):
                    await svc.outbox.publish_async(session, "order.placed", {"id": {1, 2}})
                with pytest.raises(MessageError, match="invalid command name"):
                    await svc.outbox.send_async(session, "billing", "invoice.*", {})
                with pytest.raises(MessageError, match="reserved"):
                    await svc.outbox.publish_async(
                        session, "order.placed", {}, headers={"x-attempt": 3}
                    )
                with pytest.raises(MessageError, match="publish_async"):
                    svc.outbox.publish(session, "order.placed", {})  # type: ignore[arg-type]
                await svc.outbox.publish_async(session, "order.placed", {"id": 1})
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    with (
        svc.session() as session,
        session.begin(),
        pytest.raises(MessageError, match=r"outbox.publish\(\.\.\.\)"),
    ):
        asyncio.run(svc.outbox.publish_async(session, "order.placed", {}))  # type: ignore[arg-type]
    assert _count(db_url) == 1
    svc.close()


def test_async_writers_of_one_key_wait_for_each_other_so_ids_follow_commit_order(
    db_url: str,
) -> None:
    svc = make_service("orders", db_url, None)

    async def scenario() -> list[str]:
        engine = create_async_engine(async_url(db_url))
        order: list[str] = []
        try:
            async with AsyncSession(engine) as first, first.begin():
                await svc.outbox.publish_async(first, "order.placed", {"w": "first"}, key="k")

                async def second() -> None:
                    async with AsyncSession(engine) as session, session.begin():
                        await svc.outbox.publish_async(
                            session, "order.placed", {"w": "second"}, key="k"
                        )
                    order.append("second committed")

                task = asyncio.create_task(second())
                await asyncio.sleep(0.5)
                assert not task.done()  # held by the first writer's lock on key k
                order.append("first commits")
            await asyncio.wait_for(task, 10)
        finally:
            await engine.dispose()
        return order

    assert asyncio.run(scenario()) == ["first commits", "second committed"]
    ids = [r[0]["w"] for r in rows(db_url, f"SELECT payload FROM {OUTBOX} ORDER BY id")]
    assert ids == ["first", "second"]
    svc.close()


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_an_async_write_keeps_the_trace_context_of_the_callers_span(
    db_url: str, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    svc = make_service("orders", db_url, None, tracer_provider=provider)

    async def scenario() -> str:
        engine = create_async_engine(async_url(db_url))
        try:
            with provider.get_tracer("test").start_as_current_span("POST /orders") as parent:
                async with AsyncSession(engine) as session, session.begin():
                    await svc.outbox.publish_async(session, "order.placed", {"id": 1})
            return format(parent.get_span_context().trace_id, "032x")
        finally:
            await engine.dispose()

    trace_id = asyncio.run(scenario())
    ((headers,),) = rows(db_url, f"SELECT headers FROM {OUTBOX}")
    assert headers["traceparent"].split("-")[1] == trace_id
    created = [s for s in exporter.get_finished_spans() if s.name.startswith("create ")]
    assert len(created) == 1
    assert created[0].parent is not None
    assert format(created[0].context.trace_id, "032x") == trace_id
    svc.close()


def test_the_commit_of_an_async_write_notifies_the_relay_channel(db_url: str) -> None:
    svc = make_service("orders", db_url, None)
    listener = psycopg.connect(
        async_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    try:
        listener.execute(f'LISTEN "{svc.settings.schema}.{svc.tables.outbox.name}"')

        async def write() -> None:
            engine = create_async_engine(async_url(db_url))
            try:
                async with AsyncSession(engine) as session, session.begin():
                    await svc.outbox.publish_async(session, "order.placed", {"id": 1})
            finally:
                await engine.dispose()

        asyncio.run(write())
        got = list(listener.notifies(timeout=5, stop_after=1))
    finally:
        listener.close()
    assert [n.channel for n in got] == ["outbox_inbox.outbox_messages"]
    svc.close()


def _mixed(db_url: str, mq_url: str, seen: list[tuple[str, str]]) -> Service:
    """billing with a sync and an async handler, both writing their effect."""
    billing = make_service("billing", db_url, mq_url)

    @billing.on_command("job.sync")
    def run_sync(message: Message, session: Session) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'sync')"),
            {"m": str(message.message_id)},
        )
        seen.append(("sync", threading.current_thread().name))

    @billing.on_command("job.async")
    async def run_async(message: Message, session: AsyncSession) -> None:
        await session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'async')"),
            {"m": str(message.message_id)},
        )
        seen.append(("async", threading.current_thread().name))

    return billing


def _send_jobs(orders: Service) -> None:
    with orders.session() as session, session.begin():
        orders.outbox.send(session, "billing", "job.sync", {})
        orders.outbox.send(session, "billing", "job.async", {})


def test_a_service_with_sync_and_async_handlers_runs_both_from_start(
    db_url_factory: Any, mq_url: str
) -> None:
    seen: list[tuple[str, str]] = []
    billing_db = db_url_factory()
    billing = _mixed(billing_db, mq_url, seen)
    orders = make_service("orders", db_url_factory(), mq_url)
    billing.start(workers=1)
    orders.start(receiver=False, workers=0)
    try:
        _send_jobs(orders)
        wait_until(lambda: _count(billing_db, "effects") == 2, what="both handled")
    finally:
        orders.stop()
        billing.stop()
    assert sorted(k for k, _ in seen) == ["async", "sync"]
    assert rows(billing_db, f"SELECT DISTINCT status FROM {INBOX}") == [("processed",)]
    orders.close()
    billing.close()


def test_run_async_handles_messages_and_cancellation_lets_the_batch_in_hand_commit(
    db_url_factory: Any, mq_url: str
) -> None:
    seen: list[tuple[str, str]] = []
    billing_db = db_url_factory()
    billing = _mixed(billing_db, mq_url, seen)
    orders = make_service("orders", db_url_factory(), mq_url)
    entered = threading.Event()

    @billing.on_command("job.slow")
    async def slow(message: Message, session: AsyncSession) -> None:
        entered.set()
        await asyncio.sleep(1.0)  # cancelled meanwhile: it still finishes and commits
        await session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'slow')"),
            {"m": str(message.message_id)},
        )

    async def main() -> float:
        task = asyncio.create_task(billing.run_async(workers=2))
        await asyncio.to_thread(orders.start, receiver=False, workers=0)
        try:
            await asyncio.to_thread(_send_jobs, orders)
            await asyncio.to_thread(
                wait_until, lambda: _count(billing_db, "effects") == 2, 20, 0.05, "both handled"
            )
            with orders.session() as session, session.begin():
                orders.outbox.send(session, "billing", "job.slow", {})
            await asyncio.to_thread(entered.wait, 20)
            cancelled_at = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return time.monotonic() - cancelled_at
        finally:
            await asyncio.to_thread(orders.stop)

    took = asyncio.run(main())
    assert entered.is_set()
    assert took < 20
    assert sorted(t for (t,) in rows(billing_db, "SELECT type FROM effects")) == [
        "async",
        "slow",
        "sync",
    ]
    assert rows(billing_db, f"SELECT DISTINCT status FROM {INBOX}") == [("processed",)]
    # Every handler ran on the loop's thread: the workers were tasks, not threads.
    assert {name for _, name in seen} == {threading.main_thread().name}
    assert not [t for t in threading.enumerate() if "outbox-inbox-billing" in t.name]
    orders.close()
    billing.close()
