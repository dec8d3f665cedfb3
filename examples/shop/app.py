"""orders: a Flask web shop whose orders leave as messages in the transaction that saves them.

``POST /orders`` writes the order row, the event ``orders.order.placed`` and the command
``billing.invoice.create`` in ONE transaction: all three commit, or none. The service handles
``billing.invoice.created`` by marking the order invoiced. Run it (see examples/README.md):

    OUTBOX_INBOX_DB_URL=postgresql+psycopg://postgres@127.0.0.1/orders \\
    OUTBOX_INBOX_MQ_URL=amqp://guest:guest@127.0.0.1/ \\
    python examples/shop/app.py --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import uuid
from typing import Any

from flask import Flask, abort, request
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox_inbox import Message, Reject, Service
from outbox_inbox.brokers.memory import MemoryBroker


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]
    status: Mapped[str] = mapped_column(default="placed")  # placed -> invoiced
    invoice_id: Mapped[int | None]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "customer": self.customer,
            "total_cents": self.total_cents,
            "status": self.status,
            "invoice_id": self.invoice_id,
        }


def create_service(
    db_url: str, mq_url: str | None = None, *, broker: MemoryBroker | None = None
) -> Service:
    """The orders service and its handlers (tests pass ``broker=MemoryBroker()``)."""
    orders = Service("orders", db_url=db_url, mq_url=mq_url, broker=broker)

    @orders.on_event("billing.invoice.created")
    def invoice_created(message: Message, session: Session) -> None:
        order = session.get(Order, message.payload["order_id"])
        if order is None:
            raise Reject(f"no order {message.payload['order_id']}")
        order.status = "invoiced"
        order.invoice_id = message.payload["invoice_id"]

    return orders


def create_app(orders: Service) -> Flask:
    """The web app of the orders service."""
    app = Flask("orders")

    @app.post("/orders")
    def place_order() -> tuple[dict[str, Any], int]:
        body = request.get_json(silent=True) or {}
        customer, total = body.get("customer"), body.get("total_cents")
        if not isinstance(customer, str) or not isinstance(total, int) or total <= 0:
            abort(400, "send JSON with customer (a string) and total_cents (a positive int)")
        # One id for everything this request causes, in every service it reaches.
        correlation_id = request.headers.get("X-Correlation-Id") or str(uuid.uuid4())
        with orders.session() as session, session.begin():  # one transaction, one commit
            order = Order(customer=customer, total_cents=total)
            session.add(order)
            session.flush()  # assigns order.id
            key = f"order-{order.id}"  # an order's messages leave and are handled in order
            orders.outbox.publish(
                session,
                "order.placed",
                {"order_id": order.id, "customer": customer, "total_cents": total},
                key=key,
                correlation_id=correlation_id,
            )
            orders.outbox.send(
                session,
                "billing",
                "invoice.create",
                {"order_id": order.id, "amount_cents": total},
                key=key,
                correlation_id=correlation_id,
            )
            reply = order.to_json()
        return reply, 201

    @app.get("/orders/<int:order_id>")
    def get_order(order_id: int) -> dict[str, Any]:
        with orders.session() as session:
            order = session.get(Order, order_id)
            if order is None:
                abort(404)
            return order.to_json()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True}

    return app


def from_env() -> Service:
    """The service on OUTBOX_INBOX_DB_URL and OUTBOX_INBOX_MQ_URL; also for the CLI:
    ``outbox-inbox status --app app:from_env`` (run in this folder)."""
    db_url, mq_url = os.environ.get("OUTBOX_INBOX_DB_URL"), os.environ.get("OUTBOX_INBOX_MQ_URL")
    if not db_url or not mq_url:
        sys.exit("set OUTBOX_INBOX_DB_URL and OUTBOX_INBOX_MQ_URL (see examples/README.md)")
    return create_service(db_url, mq_url)


def prepare(service: Service) -> None:
    """Create the outbox/inbox tables (migrations) and the shop's own tables."""
    service.migrate()
    Base.metadata.create_all(service.engine)


def main() -> None:
    parser = argparse.ArgumentParser(description="the orders web service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    service = from_env()
    prepare(service)
    # SIGTERM ends the web server like Ctrl-C does, so that the roles stop cleanly below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    service.start()  # relay + receiver + worker in background threads
    try:
        create_app(service).run(host=args.host, port=args.port, threaded=True)
    finally:
        service.close()


if __name__ == "__main__":
    main()
