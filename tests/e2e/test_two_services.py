"""Two services, two databases, one broker: the whole flow in one process."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from outbox_inbox import Service

from .harness import INBOX, OUTBOX, Database, hold, running, wait_until


class Rollback(Exception):
    """Raised inside a business transaction to roll it back."""


def test_two_services_event_and_command_each_handled_once_and_rollback_sends_nothing(
    db_url: str,
    db_url_factory: Callable[[], str],
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
) -> None:
    orders_url, billing_url = db_url, db_url_factory()
    orders_db, billing_db = prepare_db("orders", orders_url), prepare_db("billing", billing_url)
    orders, billing = make_service("orders", orders_url), make_service("billing", billing_url)

    # billing first: its queue and bindings must exist before orders' relay publishes to them.
    with running(billing, orders):
        with orders.session() as session, session.begin():
            event_id = orders.outbox.publish(
                session, "order.placed", {"order": 1}, key="order-1", correlation_id="flow-1"
            )
            command_id = orders.outbox.send(
                session,
                "billing",
                "invoice.create",
                {"order": 1, "publish": "invoice.created"},
                key="order-1",
                correlation_id="flow-1",
            )

        wait_until(
            lambda: billing_db.count("effects") == 2 and orders_db.count("effects") == 1,
            timeout=30,
            what="billing to handle the event and the command, and orders billing's reply",
            describe=lambda: (billing_db.count("effects"), orders_db.count("effects")),
        )

        # The rolled-back transaction, then a committed sentinel: once the sentinel has been
        # handled, anything the rolled-back transaction could have sent would have been too.
        rolled_back: list[uuid.UUID] = []
        with pytest.raises(Rollback), orders.session() as session, session.begin():
            rolled_back.append(orders.outbox.publish(session, "order.placed", {"order": 2}))
            rolled_back.append(
                orders.outbox.send(session, "billing", "invoice.create", {"order": 2})
            )
            raise Rollback
        with orders.session() as session, session.begin():
            sentinel_id = orders.outbox.send(session, "billing", "invoice.create", {"order": 3})
        wait_until(
            lambda: billing_db.count("effects", "message_id = :id", id=sentinel_id) == 1,
            timeout=30,
            what="billing to handle the sentinel command",
        )
        hold(
            2.0,
            lambda: billing_db.count("effects") == 3 and orders_db.count("effects") == 1,
            what="no further effect after the sentinel",
        )

    # Each message was handled exactly once, committed with its inbox row.
    effects = {
        row.message_id: row
        for row in billing_db.rows("SELECT message_id, type, correlation_id FROM effects")
    }
    assert set(effects) == {event_id, command_id, sentinel_id}
    assert effects[event_id].type == "orders.order.placed"
    assert effects[command_id].type == "billing.invoice.create"
    inbox = {
        row.message_id: (row.status, row.attempts, row.finished)
        for row in billing_db.rows(f"SELECT message_id, status, attempts, finished FROM {INBOX}")
    }
    assert inbox == {m: ("processed", 1, 1) for m in (event_id, command_id, sentinel_id)}

    # Nothing of the rolled-back transaction exists anywhere.
    for message_id in rolled_back:
        assert orders_db.count(OUTBOX, "message_id = :id", id=message_id) == 0
        assert billing_db.count(INBOX, "message_id = :id", id=message_id) == 0
    assert orders_db.count(OUTBOX) == 3
    assert orders_db.count(OUTBOX, "published_at IS NULL") == 0

    # The event billing published while handling the command names it as its cause and keeps
    # the conversation's correlation id, in billing's outbox and as orders received it.
    reply = billing_db.rows(
        f"SELECT message_id, routing_key, causation_id, correlation_id FROM {OUTBOX}"
    )
    assert len(reply) == 1
    reply_id, routing_key, causation_id, correlation_id = reply[0]
    assert routing_key == "billing.invoice.created"
    assert (causation_id, correlation_id) == (str(command_id), "flow-1")
    received = orders_db.rows("SELECT message_id, type, causation_id, correlation_id FROM effects")
    assert received == [(reply_id, "billing.invoice.created", str(command_id), "flow-1")]
