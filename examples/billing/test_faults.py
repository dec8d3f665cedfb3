"""billing under the faults of production, checked on its own tables (docs/testing.md).

Run with ``python -m pytest test_faults.py`` in this folder: the fault kit of `outbox_inbox.testing`
starts a private PostgreSQL and RabbitMQ (they must be installed, see docs/testing.md), runs
billing's receiver and worker and an orders relay as processes, commits orders while it kills
and restarts things, and checks that every committed order had its effects exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

from app import create_service, prepare
from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

from outbox_inbox import Service
from outbox_inbox.testing.faultkit import FaultKit


def place_order(orders: Service, session: Session, n: int) -> list[tuple[str, int]]:
    """One business transaction of orders: a command to billing and an event; billing must
    write one invoice for it and count one order for customer c<n>."""
    orders.outbox.send(session, "billing", "invoice.create", {"order_id": n, "amount_cents": 500})
    orders.outbox.publish(session, "order.placed", {"customer": f"c{n}"})
    return [("invoice", n), ("order", n)]


def billing_effects(conn: Connection) -> Iterator[tuple[str, int]]:
    """One item per effect in billing's own tables: each invoice, each counted order."""
    for (order_id,) in conn.execute(text("SELECT order_id FROM invoices")):
        yield ("invoice", order_id)
    for customer, count in conn.execute(text("SELECT customer, orders FROM accounts")):
        yield from [("order", int(customer[1:]))] * count


def test_billing_loses_and_doubles_nothing_under_faults(outbox_inbox_fault_kit: FaultKit) -> None:
    kit = outbox_inbox_fault_kit
    orders_url, billing_url = kit.database("orders"), kit.database("billing")
    orders = Service("orders", db_url=orders_url, mq_url=kit.mq_url)
    orders.migrate()
    billing = create_service(billing_url, kit.mq_url)
    prepare(billing)  # migrations and billing's tables
    billing.declare_topology()  # its queue exists before orders sends it anything
    billing.close()

    kit.start("relay", service="orders", db_url=orders_url)
    kit.start("receiver", app="app:from_env", db_url=billing_url)
    kit.start("worker", app="app:from_env", db_url=billing_url)
    kit.effects(billing_url, billing_effects)
    with kit.load(orders, place_order, rate=50):
        kit.inject("kill", role="worker", at="worker.handled", nth=10)
        kit.inject("kill", role="receiver", at="receiver.stored", nth=3)
        kit.inject("kill", role="relay", at="relay.confirmed", nth=3)
        kit.inject("postgres-restart", seconds=2)
        kit.inject("rabbitmq-restart")
        kit.inject("duplicate", times=3)
    verdict = kit.check()
    orders.close()

    print(verdict.report())
    assert verdict.valid, verdict.report()
    assert verdict.committed > 0
    # Every fault recovered; how fast depends on the machine's load: no time bound here.
    assert all(fault.recovered_s is not None for fault in verdict.faults), verdict.report()
