"""The examples' handlers, tested the way a user tests theirs: `outbox_inbox.testing` harnesses
on the in-memory broker, no RabbitMQ. Each test runs on SQLite and on PostgreSQL (conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox_inbox.testing import ServiceHarness, run_all_until_idle

from .conftest import load_example

shop_app = load_example("shop")
billing_app = load_example("billing")

HarnessFactory = Callable[..., ServiceHarness]


@pytest.fixture
def billing(outbox_inbox_harness: HarnessFactory) -> ServiceHarness:
    harness = outbox_inbox_harness(billing_app.create_service)
    billing_app.Base.metadata.create_all(harness.service.engine)
    return harness


@pytest.fixture
def shop(outbox_inbox_harness: HarnessFactory) -> ServiceHarness:
    harness = outbox_inbox_harness(shop_app.create_service)
    shop_app.Base.metadata.create_all(harness.service.engine)
    return harness


def invoices(billing: ServiceHarness) -> list[tuple[int, int]]:
    """(order_id, amount_cents) of every invoice in billing's database."""
    with billing.service.session() as session:
        rows = session.execute(
            select(billing_app.Invoice.order_id, billing_app.Invoice.amount_cents)
        )
        return [(order, amount) for order, amount in rows]


def order_of(shop: ServiceHarness, order_id: int) -> Any:
    with shop.service.session() as session:
        return session.get(shop_app.Order, order_id)


# --- billing -----------------------------------------------------------------------------------


def test_invoice_create_writes_invoice_and_publishes_invoice_created_caused_by_it(
    billing: ServiceHarness,
) -> None:
    command = billing.deliver(
        "billing.invoice.create", {"order_id": 7, "amount_cents": 4200}, correlation_id="req-1"
    )
    billing.run_until_idle()

    assert billing.inbox_row(command).status == "processed"
    assert invoices(billing) == [(7, 4200)]
    [event] = billing.published()
    assert (event.kind, event.type, event.key) == ("event", "billing.invoice.created", "order-7")
    assert event.payload == {"invoice_id": 1, "order_id": 7, "amount_cents": 4200}
    assert event.causation_id == str(command)
    assert event.correlation_id == "req-1"
    assert event.sent  # the relay published it to the broker


def test_invoice_create_delivered_twice_is_handled_once(billing: ServiceHarness) -> None:
    message_id = uuid.uuid4()
    payload = {"order_id": 7, "amount_cents": 4200}
    billing.deliver("billing.invoice.create", payload, message_id=message_id)
    billing.deliver("billing.invoice.create", payload, message_id=message_id)  # a redelivery
    billing.run_until_idle()

    assert len(billing.inbox_rows()) == 1
    assert invoices(billing) == [(7, 4200)]
    assert len(billing.published("billing.invoice.created")) == 1


def test_invoice_create_with_nonpositive_amount_is_rejected_dead_without_retry(
    billing: ServiceHarness,
) -> None:
    row = billing.handle("billing.invoice.create", {"order_id": 7, "amount_cents": 0})

    assert (row.status, row.dead_reason, row.attempts) == ("dead", "rejected", 1)
    assert row.last_error == "amount must be positive, got 0"
    assert invoices(billing) == []
    assert billing.published() == []


def test_invoice_create_failing_handler_is_dead_after_its_five_attempts(
    billing: ServiceHarness,
) -> None:
    row = billing.handle("billing.invoice.create", {"order_id": 7})  # no amount: KeyError

    assert (row.status, row.dead_reason, row.attempts) == ("dead", "max_attempts", 5)
    assert row.last_error is not None and "KeyError: 'amount_cents'" in row.last_error
    assert billing.dead() == [row]
    assert invoices(billing) == []
    assert billing.published() == []  # each failed attempt's outbox writes were rolled back


def test_order_placed_event_counts_the_customers_orders(billing: ServiceHarness) -> None:
    for order_id in (1, 2):
        billing.deliver(
            "orders.order.placed",
            {"order_id": order_id, "customer": "ada", "total_cents": 100},
            kind="event",
        )
    billing.run_until_idle()

    with billing.service.session() as session:
        assert session.get(billing_app.Account, "ada").orders == 2
    assert [r.status for r in billing.inbox_rows()] == ["processed", "processed"]


# --- orders (the shop) -------------------------------------------------------------------------


def test_post_order_writes_the_order_its_event_and_its_command_in_one_transaction(
    shop: ServiceHarness,
) -> None:
    client = shop_app.create_app(shop.service).test_client()
    response = client.post(
        "/orders",
        json={"customer": "ada", "total_cents": 4200},
        headers={"X-Correlation-Id": "req-9"},
    )

    assert response.status_code == 201
    order_id = response.get_json()["id"]
    assert order_of(shop, order_id).status == "placed"
    event, command = shop.published()
    assert (event.kind, event.type) == ("event", "orders.order.placed")
    assert event.payload == {"order_id": order_id, "customer": "ada", "total_cents": 4200}
    assert (command.kind, command.type) == ("command", "billing.invoice.create")
    assert command.payload == {"order_id": order_id, "amount_cents": 4200}
    assert {event.correlation_id, command.correlation_id} == {"req-9"}
    assert not event.sent and not command.sent  # the relay sends them after the commit


def test_invalid_order_request_writes_no_order_and_no_message(shop: ServiceHarness) -> None:
    client = shop_app.create_app(shop.service).test_client()

    assert client.post("/orders", json={"customer": "ada", "total_cents": -1}).status_code == 400
    assert shop.published() == []
    with shop.service.session() as session:
        assert session.scalar(select(func.count()).select_from(shop_app.Order)) == 0


def test_invoice_created_event_marks_the_order_invoiced(shop: ServiceHarness) -> None:
    client = shop_app.create_app(shop.service).test_client()
    order_id = client.post("/orders", json={"customer": "ada", "total_cents": 5}).get_json()["id"]

    row = shop.handle(
        "billing.invoice.created",
        {"invoice_id": 3, "order_id": order_id, "amount_cents": 5},
        kind="event",
    )

    assert row.status == "processed"
    order = order_of(shop, order_id)
    assert (order.status, order.invoice_id) == ("invoiced", 3)


def test_invoice_created_for_an_unknown_order_is_rejected(shop: ServiceHarness) -> None:
    row = shop.handle(
        "billing.invoice.created",
        {"invoice_id": 3, "order_id": 99, "amount_cents": 5},
        kind="event",
    )

    assert (row.status, row.dead_reason) == ("dead", "rejected")


# --- both services on one in-memory broker -----------------------------------------------------


def test_an_order_is_invoiced_by_billing_through_the_in_memory_broker(
    shop: ServiceHarness, billing: ServiceHarness
) -> None:
    client = shop_app.create_app(shop.service).test_client()
    order_id = client.post("/orders", json={"customer": "ada", "total_cents": 4200}).get_json()[
        "id"
    ]

    run_all_until_idle(shop, billing)

    assert client.get(f"/orders/{order_id}").get_json()["status"] == "invoiced"
    assert invoices(billing) == [(order_id, 4200)]
    assert [r.type for r in billing.processed()] == [
        "orders.order.placed",
        "billing.invoice.create",
    ]
    [reply] = shop.processed()
    [command] = shop.published("billing.invoice.create")
    assert reply.type == "billing.invoice.created"
    assert reply.causation_id == str(command.message_id)
    assert reply.correlation_id == command.correlation_id
