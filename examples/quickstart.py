"""Two services, orders and billing, exchanging a command and events over RabbitMQ.

    python examples/quickstart.py --db-url postgresql+psycopg://postgres@127.0.0.1/postgres \
        --mq-url amqp://guest:guest@127.0.0.1/

Both services share the database given but keep their tables in schemas of their own
(`orders`, `billing`), as two services with two databases would. It prints a trace and exits 0
once billing handled the command and the event, and orders handled billing's reply to this run's
order. The order's messages carry a correlation id made for this run, and billing's reply carries
it back (a handler's messages inherit the handled message's); a reply with another correlation
id, such as one an earlier run left in the queue, is traced as ignored and does not end the run.
Exit 1 when the reply does not come within 30 s.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from typing import Any

from sqlalchemy import text

from outbox_inbox import Message, Service

T0 = time.monotonic()


def trace(who: str, what: str) -> None:
    print(f"{time.monotonic() - T0:6.2f}s  {who:<8} {what}", flush=True)


class Conversation:
    """This run's correlation id, and whether billing's reply in it has been handled."""

    def __init__(self) -> None:
        self.correlation_id = str(uuid.uuid4())
        self.replied = threading.Event()


def build(db_url: str, mq_url: str) -> tuple[Service, Service, Conversation]:
    fast = {"relay_poll_interval": 0.2, "worker_poll_interval": 0.2}
    orders = Service("orders", db_url=db_url, mq_url=mq_url, schema="orders", **fast)
    billing = Service("billing", db_url=db_url, mq_url=mq_url, schema="billing", **fast)
    conversation = Conversation()

    @billing.on_command("invoice.create")
    def create_invoice(message: Message, session: Any) -> None:
        trace("billing", f"command {message.type} {message.payload}")
        invoice = session.execute(
            text("INSERT INTO billing.invoices (order_id) VALUES (:o) RETURNING id"),
            {"o": message.payload["order"]},
        ).scalar_one()
        billing.outbox.publish(
            session, "invoice.created", {"invoice": invoice, "order": message.payload["order"]}
        )

    @billing.on_event("orders.order.*")
    def order_event(message: Message, session: Any) -> None:
        trace("billing", f"event   {message.type} {message.payload}")

    @orders.on_event("billing.invoice.created")
    def invoice_created(message: Message, session: Any) -> None:
        if message.correlation_id != conversation.correlation_id:
            # Not the reply to this run's order: an earlier run's, or another sender's.
            trace(
                "orders",
                f"event   {message.type} {message.payload} of another conversation "
                f"(correlation {str(message.correlation_id)[:8]}): ignored",
            )
            return
        trace(
            "orders",
            f"event   {message.type} {message.payload} (causation {str(message.causation_id)[:8]})",
        )
        conversation.replied.set()

    return orders, billing, conversation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--mq-url", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    orders, billing, conversation = build(args.db_url, args.mq_url)
    for service in (orders, billing):
        service.migrate()
    with billing.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS billing.invoices "
                "(id serial PRIMARY KEY, order_id int NOT NULL)"
            )
        )
    with orders.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS orders.orders "
                "(id serial PRIMARY KEY, total int NOT NULL)"
            )
        )
    orders.start()
    billing.start()
    try:
        with orders.session() as session, session.begin():
            order = session.execute(
                text("INSERT INTO orders.orders (total) VALUES (42) RETURNING id")
            ).scalar_one()
            correlation = conversation.correlation_id
            orders.outbox.publish(
                session,
                "order.placed",
                {"order": order},
                key=f"order-{order}",
                correlation_id=correlation,
            )
            orders.outbox.send(
                session, "billing", "invoice.create", {"order": order}, correlation_id=correlation
            )
            trace(
                "orders",
                f"order {order} written with an event and a command (one commit, "
                f"correlation {correlation[:8]})",
            )
        with orders.session() as session, session.begin():
            orders.outbox.publish(session, "order.placed", {"order": -1})
            session.rollback()
            trace("orders", "a rolled-back transaction: its event is never sent")
        ok = conversation.replied.wait(30)
        trace("demo", "done" if ok else "timed out")
        return 0 if ok else 1
    finally:
        orders.close()
        billing.close()


if __name__ == "__main__":
    raise SystemExit(main())
