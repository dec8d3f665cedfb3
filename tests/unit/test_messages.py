from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import func, select

from outbox_inbox import InvalidMessage, MessageError, PayloadTooLarge, Service
from outbox_inbox.messages import (
    FOREIGN_ID_NAMESPACE,
    H_ORIGINAL_ID,
    OutgoingMessage,
    WireMessage,
    check_headers,
    from_wire,
    payload_json,
    to_wire,
)


def _outgoing(**overrides: object) -> OutgoingMessage:
    values: dict[str, object] = {
        "id": 7,
        "message_id": uuid.uuid4(),
        "kind": "event",
        "exchange": "events",
        "routing_key": "orders.order.placed",
        "payload": {"id": 1, "name": "Zoë"},
        "headers": {"tenant": "acme"},
        "source": "orders",
        "correlation_id": "corr-1",
        "causation_id": "cause-1",
        "key": "order-1",
        "priority": 5,
        "created_at": datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        "expires_at": datetime(2026, 1, 3, tzinfo=UTC),
        "attempt": 2,
    }
    values.update(overrides)
    return OutgoingMessage(**values)  # type: ignore[arg-type]


def test_wire_round_trip_keeps_every_envelope_field() -> None:
    message = _outgoing()
    row = from_wire(to_wire(message))
    assert row["message_id"] == message.message_id
    assert row["routing_key"] == "orders.order.placed"
    assert row["kind"] == "event"
    assert row["source"] == "orders"
    assert row["payload"] == {"id": 1, "name": "Zoë"}
    assert row["headers"]["tenant"] == "acme"
    assert row["correlation_id"] == "corr-1"
    assert row["causation_id"] == "cause-1"
    assert row["key"] == "order-1"
    assert row["tenant"] == ""
    assert from_wire(to_wire(_outgoing(headers={"x-tenant": "acme"})))["tenant"] == "acme"
    assert row["priority"] == 5
    assert row["created_at"] == message.created_at  # microseconds survive
    assert row["expires_at"] == message.expires_at


def test_a_plain_amqp_message_with_id_and_json_body_is_valid() -> None:
    row = from_wire(
        WireMessage(
            exchange="commands",
            routing_key="billing.invoice.create",
            body=b"[1,2]",
            message_id="abc-123",
            content_type=None,
        )
    )
    assert row["kind"] == "command"
    assert row["payload"] == [1, 2]
    assert row["message_id"] == uuid.uuid5(FOREIGN_ID_NAMESPACE, "abc-123")
    assert row["headers"][H_ORIGINAL_ID] == "abc-123"


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (WireMessage("events", "a.b.c", b"{}", message_id=""), "no message_id"),
        (WireMessage("events", "a.b.c", b"not json", message_id="m1"), "not JSON"),
        (WireMessage("events", "a.b.c", b"\xff\xfe", message_id="m1"), "not JSON"),
        (
            WireMessage("events", "a.b.c", b"{}", message_id="m1", content_type="text/xml"),
            "content type",
        ),
        (
            WireMessage("events", "a.b.c", b"{}", message_id="m1", headers={"x-kind": "query"}),
            "command or event",
        ),
        (
            WireMessage(
                "events", "a.b.c", b"{}", message_id="m1", headers={"x-created-at": "soon"}
            ),
            "ISO 8601",
        ),
    ],
)
def test_invalid_envelope_is_refused_with_its_reason(wire: WireMessage, reason: str) -> None:
    with pytest.raises(InvalidMessage, match=reason):
        from_wire(wire)


def test_payload_must_be_json_and_within_the_limit() -> None:
    with pytest.raises(MessageError, match="JSON"):
        payload_json({"when": datetime.now(UTC)})
    with pytest.raises(MessageError):
        payload_json(float("nan"))
    with pytest.raises(PayloadTooLarge, match="over the limit"):
        payload_json("x" * 100, limit=50)
    assert payload_json({"a": 1}, limit=50) == '{"a":1}'


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        ({"order": {"lines": [1, 2, Decimal("1.5")]}}, "payload.order.lines[2] (Decimal)"),
        ({"total": float("inf")}, "payload.total:"),
        ({(1, 2): "a tuple for a key"}, "payload key (1, 2)"),
        # JSON would silently make these keys "1" and "true": the handler would get other keys.
        ({1: "a"}, "payload key 1: JSON object keys must be strings"),
        ({"lines": [{"n": 1}, {True: "x"}]}, "payload.lines[1] key True"),
        # Every key the encoder turns into a string is found (it looks for them in its text).
        ({"a": {None: 1}}, "payload.a key None"),
        ([{-7: 1}], "payload[0] key -7"),
        ({"a": [{1e16: 1}]}, "payload.a[0] key 1e+16"),
        ({2**70: 1, 1e-07: 2}, "payload key 1180591620717411303424"),
        ([{"when": datetime.now(UTC)}], "payload[0].when (datetime)"),
    ],
)
def test_a_payload_json_cannot_hold_is_refused_naming_where_the_value_is(
    payload: object, named: str
) -> None:
    with pytest.raises(MessageError) as raised:
        payload_json(payload)
    assert named in str(raised.value)


def test_string_keys_that_look_like_numbers_or_literals_are_kept_as_they_are() -> None:
    payload = {"1": 1, "-2.5e+3": 2, "true": 3, "null": [{"false": '"4":'}]}
    assert json.loads(payload_json(payload)) == payload


def test_an_outbox_write_of_a_payload_json_cannot_hold_names_the_key_and_writes_nothing(
    tmp_path: Path,
) -> None:
    service = Service("orders", db_url=f"sqlite:///{tmp_path}/orders.db")
    service.migrate()
    refused = pytest.raises(MessageError, match=r"payload\.amount \(Decimal\)")
    with refused, service.session() as session, session.begin():
        service.outbox.publish(session, "orders.order.placed", {"amount": Decimal("9.99")})
    with service.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(service.tables.outbox)).scalar() == 0
    service.close()


def test_reserved_headers_are_refused() -> None:
    for name in ("x-key", "x-tenant"):
        with pytest.raises(MessageError, match="reserved"):
            check_headers({name: "k"})
    assert check_headers({"tenant": "acme"}) == {"tenant": "acme"}


@pytest.mark.parametrize("tenant", ["", "t" * 256, 7])
def test_an_outbox_write_refuses_a_tenant_that_is_no_short_text(
    tmp_path: Path, tenant: object
) -> None:
    service = Service("orders", db_url=f"sqlite:///{tmp_path}/orders.db")
    service.migrate()
    refused = pytest.raises(MessageError, match="tenant must be a non-empty string")
    with refused, service.session() as session, session.begin():
        service.outbox.publish(session, "orders.order.placed", {}, tenant=tenant)  # type: ignore[arg-type]
    service.close()


def test_the_outbox_insert_sent_on_the_db_api_cursor_takes_the_row_as_it_is() -> None:
    """roles.insert_outbox runs its compiled INSERT on psycopg's cursor with the row's values
    as they are, by their names: psycopg adapts every column type itself. A type that needed
    SQLAlchemy's bind processing, or a parameter SQLAlchemy renamed, would be sent wrong, so
    it must fail here first."""
    import re

    from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

    from outbox_inbox.queries import roles
    from outbox_inbox.tables import build_tables

    keys = (
        "message_id", "kind", "exchange", "routing_key", "payload", "headers", "version",
        "correlation_id", "causation_id", "key", "priority", "ttl", "delay",
    )  # fmt: skip
    compiled = roles._insert_outbox_compiled(
        build_tables("outbox_inbox"), pg_psycopg.dialect(), keys
    )
    assert compiled._bind_processors == {}  # type: ignore[attr-defined]
    assert set(re.findall(r"%\((\w+)\)s", compiled.string)) == set(keys)
    assert "RETURNING" not in compiled.string
