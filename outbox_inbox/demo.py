"""`outbox-inbox demo`: two services, orders and billing, shown as a timed trace. docs/cli.md
(``demo``) says what the trace shows, where the services keep their tables and how they talk, with
URLs and without."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update

from .errors import ConfigurationError, Reject
from .listener import Listener
from .messages import Message, OutgoingMessage
from .retry import RetryPolicy
from .service import Service
from .topology import inbox_queue

Trace = Callable[[str, str], None]


def _of_order(payload: Any) -> str:
    """`` of order N`` for a payload about order N (the demo's payloads are), else nothing."""
    if isinstance(payload, str):
        payload = json.loads(payload)  # a row's payload may still be its JSON text
    order = payload.get("order") if isinstance(payload, dict) else None
    return f" of order {order}" if order is not None else ""


class _Tracer(Listener):
    """Prints what the roles of one service do."""

    def __init__(self, service: str, trace: Trace) -> None:
        self._service, self._trace = service, trace

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        for message in messages:
            self._trace(
                self._service,
                f"relay published {message.kind} {message.routing_key}"
                f"{_of_order(message.payload)} (message {str(message.message_id)[:8]})",
            )

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        if dead:
            self._trace(self._service, f"{message.type} is DEAD: {error} (a dead letter)")
        else:
            self._trace(self._service, f"{message.type} failed: {error!r}; RETRY scheduled")


class Demo:
    """The two demo services, their business tables and the expected outcome."""

    def __init__(self, *, db_url: str | None, mq_url: str | None, trace: Trace) -> None:
        self.trace = trace
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if db_url is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="outbox-inbox-demo-")
        files = Path(self._tmp.name) if self._tmp is not None else None

        def service(name: str, **options: Any) -> Service:
            """A service with its own SQLite file or schema, traced, polling fast."""
            return Service(
                f"demo_{name}" if mq_url else name,
                db_url=db_url if files is None else f"sqlite:///{files / f'{name}.db'}",
                mq_url=mq_url,
                schema=f"demo_{name}",
                listener=_Tracer(name, trace),
                relay_poll_interval=0.1,
                worker_poll_interval=0.1,
                **options,
            )

        self.orders = service("orders")
        self.billing = service(
            "billing", retry=RetryPolicy(initial=0.5, multiplier=2, max_attempts=3)
        )
        self.invoiced = threading.Event()
        self._failed_once = False
        self.orders_table = Table(
            "orders",
            MetaData(schema=None if self.orders.sqlite else "demo_orders"),
            Column("id", Integer, primary_key=True),
            Column("total", Integer, nullable=False),
            Column("state", String(20), nullable=False),
        )
        self.invoices_table = Table(
            "invoices",
            MetaData(schema=None if self.billing.sqlite else "demo_billing"),
            Column("id", Integer, primary_key=True),
            Column("order_id", Integer, nullable=False),
        )
        self._register()

    def _register(self) -> None:
        orders, billing, trace = self.orders, self.billing, self.trace

        @billing.on_command("invoice.create")
        def create_invoice(message: Message, session: Any) -> None:
            order = message.payload["order"]
            if message.payload["total"] <= 0:
                trace("billing", f"invoice.create for order {order}: total is not positive")
                raise Reject(f"order {order} has total {message.payload['total']}")
            if not self._failed_once:
                self._failed_once = True
                trace(
                    "billing",
                    f"invoice.create for order {order}, attempt {message.attempt}:"
                    " the payment provider times out",
                )
                raise TimeoutError("payment provider timed out")
            invoice = session.execute(
                insert(self.invoices_table)
                .values(order_id=order)
                .returning(self.invoices_table.c.id)
            ).scalar_one()
            billing.outbox.publish(session, "invoice.created", {"order": order, "invoice": invoice})
            trace(
                "billing",
                f"invoice.create for order {order}, attempt {message.attempt}:"
                f" invoice {invoice} written, event invoice.created in the same commit",
            )

        @billing.on_event(f"{orders.name}.order.placed")
        def order_placed(message: Message, session: Any) -> None:
            trace(
                "billing",
                f"event {message.type}: order {message.payload['order']}"
                f" noted (correlation {str(message.correlation_id)[:8]})",
            )

        @orders.on_event(f"{billing.name}.invoice.created")
        def invoice_created(message: Message, session: Any) -> None:
            order = message.payload["order"]
            session.execute(
                update(self.orders_table)
                .where(self.orders_table.c.id == order)
                .values(state="invoiced")
            )
            trace(
                "orders",
                f"event {message.type}: order {order} is invoiced"
                f" (caused by {str(message.causation_id)[:8]})",
            )
            self.invoiced.set()

    def setup(self) -> None:
        """Create the tables (migrations plus the demo's business tables). Raises
        ConfigurationError when a demo inbox queue has a consumer already."""
        for service in (self.orders, self.billing):
            with service.broker.operator() as admin:
                info = admin.queue_info(inbox_queue(service.name))
            if info and info[1]:
                raise ConfigurationError(
                    f"{inbox_queue(service.name)} on {service.broker.description} has a consumer"
                    " already: another demo is running there"
                )
        for service, table in (
            (self.orders, self.orders_table),
            (self.billing, self.invoices_table),
        ):
            service.migrate()
            table.metadata.create_all(service.engine)

    def place_order(self, total: int, *, rollback: bool = False) -> int:
        """Write an order, its event and its command in one transaction."""
        with self.orders.session() as session, session.begin():
            order: int = session.execute(
                insert(self.orders_table)
                .values(total=total, state="placed")
                .returning(self.orders_table.c.id)
            ).scalar_one()
            self.orders.outbox.publish(session, "order.placed", {"order": order}, key=f"o{order}")
            self.orders.outbox.send(
                session,
                self.billing.name,
                "invoice.create",
                {"order": order, "total": total},
                key=f"o{order}",
            )
            if rollback:
                session.rollback()
                self.trace("orders", f"order {order} written, then ROLLED BACK: nothing is sent")
                return order
        self.trace(
            "orders",
            f"order {order} (total {total}) written with event order.placed"
            f" and command {self.billing.name}.invoice.create: one commit",
        )
        return order

    def summary(self) -> dict[str, Any]:
        with self.orders.engine.connect() as conn:
            query = select(self.orders_table.c.id, self.orders_table.c.state)
            states: dict[int, str] = {row.id: row.state for row in conn.execute(query)}
        with self.billing.engine.connect() as conn:
            inbox = self.billing.tables.inbox
            columns = (inbox.c.routing_key, inbox.c.payload, inbox.c.status, inbox.c.dead_reason)
            rows = conn.execute(select(*columns).order_by(inbox.c.id)).all()
        return {"orders": states, "billing_inbox": [tuple(r) for r in rows]}

    def close(self) -> None:
        self.orders.close()
        self.billing.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def run_demo(
    *, db_url: str | None, mq_url: str | None, echo: Callable[[str], None], timeout: float = 30.0
) -> bool:
    """Run the demo, printing the trace through `echo`; True when every step happened."""
    start = time.monotonic()
    lock = threading.Lock()

    def trace(who: str, what: str) -> None:
        with lock:
            echo(f"{time.monotonic() - start:6.2f}s  {who:<8} {what}")

    demo = Demo(db_url=db_url, mq_url=mq_url, trace=trace)
    try:
        demo.setup()
        demo.orders.start()
        demo.billing.start()
        trace(
            "demo",
            f"orders and billing running on {demo.orders.engine.dialect.name}"
            f" and {demo.orders.broker.description}",
        )
        demo.place_order(42)
        demo.place_order(-5)
        demo.place_order(13, rollback=True)
        done = demo.invoiced.wait(timeout)
        deadline = time.monotonic() + timeout
        dead = False
        while time.monotonic() < deadline and not dead:
            dead = any(status == "dead" for _, _, status, _ in demo.summary()["billing_inbox"])
            time.sleep(0.1)
        demo.orders.stop()
        demo.billing.stop()
        summary = demo.summary()
        trace("demo", f"orders: {summary['orders']}")
        for routing_key, payload, status, reason in summary["billing_inbox"]:
            about = f"{routing_key}{_of_order(payload)}"
            why = f" ({reason})" if reason else ""
            trace("demo", f"billing inbox: {about:<37} {status}{why}")
        return done and dead
    finally:
        demo.close()
