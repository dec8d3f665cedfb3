"""Declaring the topology is idempotent and a conflicting declaration is reported."""

from __future__ import annotations

import pika
import pytest

from outbox_inbox import Service, TopologyMismatch


def _queue_bindings(mq_url: str, queue: str, keys: list[tuple[str, str]]) -> list[bool]:
    """Whether a message published on each (exchange, key) reaches `queue` (via a probe)."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        reached = []
        for exchange, key in keys:
            channel.queue_purge(queue)
            channel.basic_publish(exchange, key, b"{}", pika.BasicProperties(message_id="probe"))
            method, _, _ = channel.basic_get(queue, auto_ack=True)
            reached.append(method is not None)
        return reached
    finally:
        connection.close()


def test_declaring_twice_changes_nothing_and_binds_commands_and_event_patterns(
    mq_url: str,
) -> None:
    svc = Service("billing", db_url="postgresql+psycopg://unused/x", mq_url=mq_url)

    @svc.on_event("orders.order.*")
    def placed(message: object, session: object) -> None: ...

    svc.declare_topology()
    svc.declare_topology()
    reached = _queue_bindings(
        mq_url,
        "billing.inbox",
        [
            ("commands", "billing.invoice.create"),
            ("events", "orders.order.placed"),
            ("events", "orders.customer.created"),
            ("commands", "shipping.parcel.ship"),
        ],
    )
    assert reached == [True, True, False, False]


def test_conflicting_queue_arguments_raise_topology_mismatch(mq_url: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        connection.channel().queue_declare("billing.inbox", durable=False)
    finally:
        connection.close()
    svc = Service("billing", db_url="postgresql+psycopg://unused/x", mq_url=mq_url)
    with pytest.raises(TopologyMismatch, match=r"billing\.inbox"):
        svc.declare_topology()
