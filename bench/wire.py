"""The messages every figure moves: the relay's own wire format, so raw figures move the same
bytes as the library; and the batch sizes the raw figures share with the library's defaults."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pika
from pika.spec import BasicProperties

from outbox_inbox.messages import EVENT, OutgoingMessage, WireMessage, to_wire

WINDOW = 500  # unconfirmed publishes in flight (the library's publish_window default)
PREFETCH = 500  # consumer prefetch (the library's prefetch default)
ACK_EVERY = 250  # raw consumer: one multiple-ack per this many deliveries
INSERT_BATCH = 250  # raw inbox insert: rows per statement and commit (receive_batch_size)
CLAIM_BATCH = 50  # raw claim: rows per claim (worker_batch_size)
OUTBOX_TXN = 500  # messages per business transaction when filling an outbox
EVENT_NAME = "order.placed"


def payload(i: int) -> dict[str, Any]:
    """The business payload of message `i`: about 150 bytes of JSON."""
    return {
        "order_id": i,
        "customer": f"customer-{i % 1000:04d}",
        "amount_cents": 1999 + i % 500,
        "currency": "EUR",
        "lines": [{"sku": f"SKU-{i % 97:04d}", "qty": 1 + i % 3}, {"sku": "SKU-0042", "qty": 1}],
    }


#: The same payload built by PostgreSQL from an integer `i`, for backlogs seeded in SQL.
PAYLOAD_SQL = (
    "jsonb_build_object('order_id', i, 'customer', 'customer-' || lpad(mod(i, 1000)::text, 4, '0'),"
    " 'amount_cents', 1999 + mod(i, 500), 'currency', 'EUR', 'lines', jsonb_build_array("
    "jsonb_build_object('sku', 'SKU-' || lpad(mod(i, 97)::text, 4, '0'), 'qty', 1 + mod(i, 3)),"
    " jsonb_build_object('sku', 'SKU-0042', 'qty', 1)))"
)


def make_wires(n: int, source: str, exchange: str, routing_key: str) -> list[WireMessage]:
    """N messages exactly as the relay would put them on the wire."""
    now = datetime.now(UTC)
    wires = []
    for i in range(n):
        mid = uuid.uuid4()
        message = OutgoingMessage(
            id=i + 1,
            message_id=mid,
            kind=EVENT,
            exchange=exchange,
            routing_key=routing_key,
            payload=payload(i),
            headers={},
            source=source,
            correlation_id=str(mid),
            created_at=now,
        )
        wires.append(to_wire(message))
    return wires


def pika_properties(wire: WireMessage) -> BasicProperties:
    """The AMQP properties the library's publisher sets on `wire`, so that the raw figures
    publish exactly what the relay does (tests/unit/test_publish_frames.py holds the relay's
    frames to these properties)."""
    return BasicProperties(
        message_id=wire.message_id,
        type=wire.type,
        correlation_id=wire.correlation_id,
        content_type=wire.content_type,
        timestamp=wire.timestamp,
        priority=wire.priority,
        app_id=wire.app_id,
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=dict(wire.headers),
    )
