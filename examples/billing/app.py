"""billing: a worker service with no web server.

It handles the command ``billing.invoice.create`` by writing an invoice and publishing the event
``billing.invoice.created`` in the same transaction, and follows the event ``orders.order.placed``
to count each customer's orders. Run it (see examples/README.md):

    OUTBOX_INBOX_DB_URL=postgresql+psycopg://postgres@127.0.0.1/billing \\
    OUTBOX_INBOX_MQ_URL=amqp://guest:guest@127.0.0.1/ \\
    python examples/billing/app.py
"""

from __future__ import annotations

import logging
import os
import sys

from sqlalchemy import select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox_inbox import Message, Reject, RetryPolicy, Service
from outbox_inbox.brokers.memory import MemoryBroker

log = logging.getLogger("billing")


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(unique=True)
    amount_cents: Mapped[int]


class Account(Base):
    __tablename__ = "accounts"

    customer: Mapped[str] = mapped_column(primary_key=True)
    orders: Mapped[int] = mapped_column(default=0)


def create_service(
    db_url: str, mq_url: str | None = None, *, broker: MemoryBroker | None = None
) -> Service:
    """The billing service and its handlers (tests pass ``broker=MemoryBroker()``)."""
    billing = Service("billing", db_url=db_url, mq_url=mq_url, broker=broker)

    # A failure other than Reject is retried with this backoff; after 5 attempts it is dead.
    @billing.on_command("invoice.create", retry=RetryPolicy(initial=1, max_attempts=5))
    def create_invoice(message: Message, session: Session) -> None:
        order_id, amount = message.payload["order_id"], message.payload["amount_cents"]
        if amount <= 0:
            raise Reject(f"amount must be positive, got {amount}")  # retrying cannot help
        # The inbox runs each message once; this guards against two messages for one order.
        invoice = session.scalar(select(Invoice).where(Invoice.order_id == order_id))
        if invoice is None:
            invoice = Invoice(order_id=order_id, amount_cents=amount)
            session.add(invoice)
            session.flush()  # assigns invoice.id
        # Written in the handler's transaction: it leaves only if the invoice commits, and
        # carries causation_id = this command's id and its correlation_id.
        billing.outbox.publish(
            session,
            "invoice.created",
            {"invoice_id": invoice.id, "order_id": order_id, "amount_cents": amount},
            key=f"order-{order_id}",
        )
        log.info("invoice %d for order %d", invoice.id, order_id)

    @billing.on_event("orders.order.placed")
    def count_orders(message: Message, session: Session) -> None:
        customer = message.payload["customer"]
        account = session.get(Account, customer) or Account(customer=customer, orders=0)
        account.orders += 1
        session.add(account)

    return billing


def from_env() -> Service:
    """The service on OUTBOX_INBOX_DB_URL and OUTBOX_INBOX_MQ_URL; also for the CLI:
    ``outbox-inbox status --app app:from_env`` (run in this folder)."""
    db_url, mq_url = os.environ.get("OUTBOX_INBOX_DB_URL"), os.environ.get("OUTBOX_INBOX_MQ_URL")
    if not db_url or not mq_url:
        sys.exit("set OUTBOX_INBOX_DB_URL and OUTBOX_INBOX_MQ_URL (see examples/README.md)")
    return create_service(db_url, mq_url)


def prepare(service: Service) -> None:
    """Create the outbox/inbox tables (migrations) and billing's own tables."""
    service.migrate()
    Base.metadata.create_all(service.engine)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    service = from_env()
    prepare(service)
    service.run()  # relay + receiver + worker until SIGTERM or Ctrl-C


if __name__ == "__main__":
    main()
