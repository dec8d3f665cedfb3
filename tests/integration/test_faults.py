"""Fault messages on the real servers: orders sends billing a command, billing ends it dead, and
orders' on_fault handler gets the fault exactly once, on every terminal path of the worker.

The poison path (a worker killed by its message until ``abandon_after``) needs real processes:
tests/e2e/test_poison.py's pattern, in tests/e2e/test_faults_poison.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from helpers import make_service, publish_raw, rows, scalar, wait_until
from outbox_inbox import (
    Fault,
    HandlerContext,
    Message,
    Reject,
    RetryPolicy,
    Service,
)
from outbox_inbox.fingerprint import fingerprint

BILLING_INBOX = "billing_box.inbox_messages"
BILLING_OUTBOX = "billing_box.outbox_messages"
ORDERS_INBOX = "orders_box.inbox_messages"


@dataclass(frozen=True)
class Invoice:
    amount: int


class Received:
    """What orders' on_fault handler got: (fault message, typed payload), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[tuple[Message, Fault]] = []

    def add(self, message: Message, fault: Fault) -> None:
        with self._lock:
            self.items.append((message, fault))

    def once(self, db_url: str) -> tuple[Message, Fault]:
        """The one fault received; fails if none comes, or if a second one does."""
        wait_until(lambda: self.items, timeout=30, what="a fault at orders")
        time.sleep(1.0)  # a duplicate would have come by now: the roles poll every 0.1 s
        assert len(self.items) == 1, self.items
        faults = rows(
            db_url, f"SELECT status FROM {ORDERS_INBOX} WHERE routing_key LIKE 'orders.fault.%'"
        )
        assert faults == [("processed",)]
        return self.items[0]


def _orders(db_url: str, mq_url: str) -> tuple[Service, Received]:
    """orders in its own schema, with an on_fault handler of billing.invoice.create."""
    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    received = Received()

    @orders.on_fault("billing.invoice.create")
    def on_invoice_fault(ctx: HandlerContext, payload: Fault) -> None:
        received.add(ctx.message, payload)

    return orders, received


@contextmanager
def _running(*services: Service) -> Iterator[None]:
    for service in services:
        service.start(workers=1)
    try:
        yield
    finally:
        for service in services:
            service.close()


def _send(orders: Service, command: str = "invoice.create", **payload: Any) -> uuid.UUID:
    with orders.session() as session, session.begin():
        return orders.outbox.send(
            session, "billing", command, payload or {"amount": 12}, correlation_id="order-7"
        )


def _check_fault(
    message: Message, fault: Fault, sent: uuid.UUID, reason: str, *, routing_key: str
) -> None:
    assert fault.message_id == str(sent)
    assert fault.routing_key == routing_key
    assert fault.kind == "command"
    assert fault.service == "billing"
    assert fault.reason == reason
    assert fault.correlation_id == "order-7"
    assert fault.causation_id is None  # orders sent it outside a handler
    # The fault continues the conversation: caused by the dead message, in its correlation.
    assert message.type == f"orders.fault.{routing_key}"
    assert message.kind == "command"
    assert message.source == "billing"
    assert message.causation_id == str(sent)
    assert message.correlation_id == "order-7"


def test_a_rejected_command_sends_its_sender_one_fault(db_url: str, mq_url: str) -> None:
    orders, received = _orders(db_url, mq_url)
    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        raise Reject("customer 42 is closed\nsecond line")

    with _running(orders, billing):
        sent = _send(orders)
        message, fault = received.once(db_url)
    _check_fault(message, fault, sent, "rejected", routing_key="billing.invoice.create")
    assert fault.error == "customer 42 is closed"
    assert fault.fingerprint.startswith("Reject at ")
    assert "test_faults.py:create" in fault.fingerprint


def test_a_command_that_exhausts_its_attempts_sends_one_fault(db_url: str, mq_url: str) -> None:
    orders, received = _orders(db_url, mq_url)
    billing = make_service("billing", db_url, mq_url, schema="billing_box")
    calls: list[int] = []

    @billing.on_command("invoice.create", retry=RetryPolicy(initial=0.1, max_attempts=3))
    def create(message: Message, session: Any) -> None:
        calls.append(1)
        raise TimeoutError("the ledger did not answer")

    with _running(orders, billing):
        sent = _send(orders)
        message, fault = received.once(db_url)
    assert len(calls) == 3
    _check_fault(message, fault, sent, "max_attempts", routing_key="billing.invoice.create")
    assert fault.error == "the ledger did not answer"
    assert fault.fingerprint.startswith("TimeoutError at ")


def test_a_command_with_an_invalid_typed_payload_sends_one_fault(db_url: str, mq_url: str) -> None:
    orders, received = _orders(db_url, mq_url)
    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any, payload: Invoice) -> None:
        raise AssertionError("never called with an invalid payload")

    with _running(orders, billing):
        sent = _send(orders, amount="twelve")
        message, fault = received.once(db_url)
    _check_fault(message, fault, sent, "invalid_payload", routing_key="billing.invoice.create")
    assert fault.error is not None and "payload.amount must be an integer" in fault.error
    assert fault.fingerprint == "invalid_payload"  # grouped by its reason (failures.md)


def test_a_command_without_a_handler_sends_one_fault(db_url: str, mq_url: str) -> None:
    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    received = Received()

    @orders.on_fault("billing.#")  # a pattern: every fault of billing's
    def on_billing_fault(ctx: HandlerContext, payload: Fault) -> None:
        received.add(ctx.message, payload)

    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        pass

    with _running(orders, billing):
        sent = _send(orders, "invoice.void")
        message, fault = received.once(db_url)
    _check_fault(message, fault, sent, "no_handler", routing_key="billing.invoice.void")
    assert fault.error is not None
    assert fault.error.startswith("no handler for billing.invoice.void")
    assert fault.fingerprint == fingerprint("no_handler")


def test_an_expired_command_sends_one_fault_and_a_foreign_one_none(
    db_url: str, mq_url: str
) -> None:
    """The sender is the message's app_id: a service in another language that sets it gets
    faults; a client without one gets none."""
    orders, received = _orders(db_url, mq_url)
    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        raise AssertionError("an expired command is never handled")

    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    sent, foreign = str(uuid.uuid4()), str(uuid.uuid4())
    with _running(orders, billing):
        for message_id, app_id in ((sent, "orders"), (foreign, None)):
            publish_raw(
                mq_url,
                "commands",
                "billing.invoice.create",
                json.dumps({"amount": 1}).encode(),
                message_id=message_id,
                correlation_id="order-7",
                app_id=app_id,
                headers={"x-expires-at": past},
            )
        message, fault = received.once(db_url)
        dead = rows(db_url, f"SELECT message_id, dead_reason FROM {BILLING_INBOX}")
    _check_fault(message, fault, uuid.UUID(sent), "expired", routing_key="billing.invoice.create")
    assert fault.error is None
    assert fault.fingerprint == fingerprint("expired")
    assert sorted((str(m), r) for m, r in dead) == sorted([(sent, "expired"), (foreign, "expired")])
    assert scalar(db_url, f"SELECT count(*) FROM {BILLING_OUTBOX}") == 1  # no fault for foreign


def test_a_fault_without_an_on_fault_handler_is_processed_not_dead(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        raise Reject("no")

    caplog.set_level("INFO", logger="outbox_inbox.faults")
    with _running(orders, billing):
        _send(orders)
        wait_until(
            lambda: rows(db_url, f"SELECT status FROM {ORDERS_INBOX}") == [("processed",)],
            timeout=30,
            what="the fault processed at orders",
        )
    logged = [r for r in caplog.records if r.name == "outbox_inbox.faults"]
    assert any("billing.invoice.create" in r.getMessage() for r in logged), logged
    assert all(r.levelname == "INFO" for r in logged)


def test_a_fault_whose_handler_rejects_it_ends_dead_without_a_fault_of_its_own(
    db_url: str, mq_url: str
) -> None:
    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    billing = make_service("billing", db_url, mq_url, schema="billing_box")

    @orders.on_fault("billing.invoice.create")
    def on_fault(message: Message, session: Any) -> None:
        raise Reject("cannot take it")

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        raise Reject("no")

    with _running(orders, billing):
        _send(orders)
        wait_until(
            lambda: rows(db_url, f"SELECT status FROM {ORDERS_INBOX}") == [("dead",)],
            timeout=30,
            what="the fault dead at orders",
        )
        time.sleep(1.0)
        outbox = "SELECT count(*) FROM orders_box.outbox_messages"
        assert scalar(db_url, f"{outbox} WHERE routing_key LIKE 'billing.fault.%'") == 0
        assert scalar(db_url, f"SELECT count(*) FROM {BILLING_INBOX}") == 1


def test_an_event_gets_a_fault_only_where_the_receiver_opts_in(db_url: str, mq_url: str) -> None:
    orders = make_service("orders", db_url, mq_url, schema="orders_box")
    received = Received()

    @orders.on_fault("orders.order.placed")
    def on_fault(ctx: HandlerContext, payload: Fault) -> None:
        received.add(ctx.message, payload)

    billing = make_service("billing", db_url, mq_url, schema="billing_box", event_faults=True)
    shipping = make_service("shipping", db_url, mq_url, schema="shipping_box")
    for service in (billing, shipping):

        @service.on_event("orders.order.placed")
        def placed(message: Message, session: Any) -> None:
            raise Reject("not today")

    with _running(orders, billing, shipping):
        with orders.session() as session, session.begin():
            sent = orders.outbox.publish(session, "order.placed", {"n": 1})
        message, fault = received.once(db_url)
        wait_until(
            lambda: (
                scalar(
                    db_url, "SELECT count(*) FROM shipping_box.inbox_messages WHERE status = 'dead'"
                )
                == 1
            )
        )
    assert (fault.message_id, fault.kind, fault.service) == (str(sent), "event", "billing")
    assert message.type == "orders.fault.orders.order.placed"
    assert scalar(db_url, "SELECT count(*) FROM shipping_box.outbox_messages") == 0


# --- the dead mark and the fault commit together ---------------------------------------------

REFUSE_DEAD = """
CREATE FUNCTION billing_box.refuse_dead() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'dead' THEN
        RAISE EXCEPTION 'test trigger: marking % dead is refused', NEW.message_id;
    END IF;
    RETURN NEW;
END $$
"""
# Fires when the transaction commits: every statement, the fault's insert included, succeeded.
DEAD_AT_COMMIT = (
    f"CREATE CONSTRAINT TRIGGER refuse_dead AFTER UPDATE ON {BILLING_INBOX}"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION billing_box.refuse_dead()"
)


def _rejecting_billing(db_url: str, mq_url: str) -> tuple[Service, list[int]]:
    """billing, rejecting every invoice.create; and the list its handler appends a call to.
    abandon_after is high: refused commits count as unfinished claims, and the row must end
    dead as rejected once its mark commits, not as abandoned."""
    billing = make_service("billing", db_url, mq_url, schema="billing_box", abandon_after=100)
    calls: list[int] = []

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        calls.append(1)
        raise Reject("customer 42 is closed")

    return billing, calls


def test_a_dead_mark_refused_at_commit_sends_no_fault_until_it_commits(
    db_url: str, mq_url: str
) -> None:
    orders, received = _orders(db_url, mq_url)
    billing, calls = _rejecting_billing(db_url, mq_url)

    _sql(billing, REFUSE_DEAD, DEAD_AT_COMMIT)
    with _running(orders, billing):
        sent = _send(orders)
        wait_until(lambda: len(calls) >= 3, timeout=30, what="three refused dead marks")
        # No fault row without the dead mark: the outbox holds none while the row is not dead.
        status = rows(db_url, f"SELECT status FROM {BILLING_INBOX}")
        assert status == [("pending",)]
        assert scalar(db_url, f"SELECT count(*) FROM {BILLING_OUTBOX}") == 0
        assert received.items == []
        _sql(billing, f"DROP TRIGGER refuse_dead ON {BILLING_INBOX}")
        message, fault = received.once(db_url)
    _check_fault(message, fault, sent, "rejected", routing_key="billing.invoice.create")
    assert rows(db_url, f"SELECT status, dead_reason FROM {BILLING_INBOX}") == [
        ("dead", "rejected")
    ]
    assert scalar(db_url, f"SELECT count(*) FROM {BILLING_OUTBOX}") == 1


def test_a_fault_the_database_refuses_leaves_the_row_not_dead(db_url: str, mq_url: str) -> None:
    """No dead mark without the fault: the fault's insert fails, the mark rolls back."""
    orders, received = _orders(db_url, mq_url)
    billing, calls = _rejecting_billing(db_url, mq_url)

    _sql(
        billing,
        "CREATE FUNCTION billing_box.refuse_fault() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'test trigger: no fault'; END $$",
        f"CREATE TRIGGER refuse_fault BEFORE INSERT ON {BILLING_OUTBOX}"
        " FOR EACH ROW EXECUTE FUNCTION billing_box.refuse_fault()",
    )
    with _running(orders, billing):
        sent = _send(orders)
        wait_until(lambda: len(calls) >= 3, timeout=30, what="three refused faults")
        assert rows(db_url, f"SELECT status FROM {BILLING_INBOX}") == [("pending",)]
        _sql(billing, f"DROP TRIGGER refuse_fault ON {BILLING_OUTBOX}")
        message, fault = received.once(db_url)
    _check_fault(message, fault, sent, "rejected", routing_key="billing.invoice.create")


def _sql(service: Service, *statements: str) -> None:
    with service.engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))
