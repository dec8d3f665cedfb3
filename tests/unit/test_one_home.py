"""One home per concept: `messages.from_row` maps every table row to its message, and
`format_age` writes the ages the CLI and the dashboard show."""

from __future__ import annotations

import uuid
from dataclasses import fields
from datetime import UTC, datetime

from outbox_inbox.dashboard.views import format_age
from outbox_inbox.messages import Message, OutgoingMessage, from_row, message_from_row
from outbox_inbox.tables import build_tables
from outbox_inbox.testing import InboxRow, PublishedMessage

TABLES = build_tables("outbox_inbox")


def _row(table: object) -> dict[str, object]:
    """A row of `table` whose every column holds a value of its own (headers: none)."""
    return {c.name: f"{c.name}-value" for c in table.c} | {"headers": None}  # type: ignore[attr-defined]


def test_a_claimed_inbox_row_becomes_the_handlers_message_field_by_field() -> None:
    row = _row(TABLES.inbox) | {"attempts": 3}
    message = message_from_row(row)
    assert (message.type, message.headers, message.attempt) == (row["routing_key"], {}, 3)
    for f in fields(Message):
        if f.name not in ("type", "headers", "attempt"):
            assert getattr(message, f.name) == row[f.name], f.name


def test_an_outbox_row_becomes_the_relays_message_field_by_field() -> None:
    row = _row(TABLES.outbox)
    message = from_row(OutgoingMessage, row, source="orders", attempt=2)
    assert (message.source, message.attempt, message.headers) == ("orders", 2, {})
    for f in fields(OutgoingMessage):
        if f.name not in ("source", "attempt", "headers"):
            assert getattr(message, f.name) == row[f.name], f.name


def test_the_harness_views_read_their_fields_from_the_same_columns() -> None:
    stored = from_row(InboxRow, _row(TABLES.inbox) | {"headers": {"h": 1}})
    assert (stored.type, stored.status, stored.headers) == (
        "routing_key-value",
        "status-value",
        {"h": 1},
    )
    sent = from_row(PublishedMessage, _row(TABLES.outbox), sent=True)
    assert (sent.type, sent.key, sent.sent) == ("routing_key-value", "key-value", True)


def test_a_decoded_delivery_has_no_receipt_time_and_keeps_the_default() -> None:
    decoded = {"message_id": uuid.uuid4(), "routing_key": "orders.placed", "payload": {}}
    message = from_row(
        Message, decoded | {"created_at": datetime(2026, 1, 1, tzinfo=UTC)}, attempt=0
    )
    assert (message.received_at, message.attempt, message.kind) == (None, 0, "event")


def test_an_age_is_written_in_its_two_largest_units() -> None:
    assert [format_age(s) for s in (None, -5, 45, 723, 18_420, 273_600)] == [
        "-",
        "0s",
        "45s",
        "12m03s",
        "5h07m",
        "3d04h",
    ]
