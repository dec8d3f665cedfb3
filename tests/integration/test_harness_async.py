"""`ServiceHarness` with ``async def`` handlers: worked by the asyncio worker, on PostgreSQL.

A FastAPI service's handlers are async; its tests use the same harness as everyone else's. The
harness runs them on the asyncio worker (the AsyncSession proxies the marking transaction), so
their effects and what they publish commit with the processed mark; from an async test too.
On SQLite, where the asyncio worker cannot run, it says so instead of letting every message
fail.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import text

from helpers import rows
from outbox_inbox import AsyncHandlerContext, MemoryBroker, Message, Service
from outbox_inbox.errors import ConfigurationError
from outbox_inbox.testing import ServiceHarness


def _billing(db_url: str) -> Service:
    service = Service("billing", db_url=db_url, broker=MemoryBroker())

    @service.on_command("invoice.create")
    async def create(ctx: AsyncHandlerContext) -> None:
        order = ctx.message.payload["order"]
        if order < 0:
            raise ValueError("no such order")
        await ctx.session.execute(text("INSERT INTO invoices (order_id) VALUES (:o)"), {"o": order})
        await ctx.publish("invoice.created", {"order": order})

    @service.on_event("billing.invoice.created")
    def audit(message: Message, session: object) -> None:  # a sync handler next to it
        pass

    return service


def test_a_harness_runs_async_handlers_in_the_transaction_that_marks_them(db_url: str) -> None:
    service = _billing(db_url)
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (order_id int PRIMARY KEY)"))
    with ServiceHarness(service) as harness:
        harness.deliver("billing.invoice.create", {"order": 7})
        harness.deliver("billing.invoice.create", {"order": -1})
        harness.run_until_idle()
        processed = [(r.type, r.payload["order"]) for r in harness.processed()]
        # The command, and the event its handler published, which billing subscribes to.
        assert sorted(processed) == [("billing.invoice.create", 7), ("billing.invoice.created", 7)]
        [dead] = harness.dead()
        assert dead.payload == {"order": -1} and "no such order" in (dead.last_error or "")
        assert [p.payload for p in harness.published("billing.invoice.created")] == [{"order": 7}]
    assert rows(db_url, "SELECT order_id FROM invoices") == [(7,)]


def test_a_harness_with_async_handlers_works_from_an_async_test(db_url: str) -> None:
    service = _billing(db_url)
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (order_id int PRIMARY KEY)"))

    async def test_body() -> int:  # as a pytest-asyncio test would run: inside a loop
        with ServiceHarness(service) as harness:
            harness.deliver("billing.invoice.create", {"order": 8})
            harness.run_until_idle()
            return len(harness.processed())

    assert asyncio.run(test_body()) == 2  # the command and the event its handler published


def test_a_harness_on_sqlite_says_that_async_handlers_need_postgresql(tmp_path: Path) -> None:
    service = _billing(f"sqlite:///{tmp_path / 'billing.db'}")
    with ServiceHarness(service) as harness:
        harness.deliver("billing.invoice.create", {"order": 7})
        with pytest.raises(ConfigurationError, match="async handlers, which run on PostgreSQL"):
            harness.run_until_idle()
        assert [r.status for r in harness.inbox_rows()] == ["pending"]  # nothing was lost
