"""The receiver's rules for what a sender puts on the wire (docs/wire-format.md), one by one,
and the AMQP codec that lets every value RabbitMQ accepts reach them."""

from __future__ import annotations

import decimal
import struct
import uuid
from datetime import UTC, datetime
from typing import Any

import amqp_raw
import pytest

from outbox_inbox import InvalidMessage
from outbox_inbox.brokers import amqp_fields
from outbox_inbox.brokers.amqp_fields import (
    MAX_DEPTH,
    RawField,
    decode_properties,
    encode_properties,
    forward_properties,
)
from outbox_inbox.messages import (
    FOREIGN_ID_NAMESPACE,
    H_AMQP_TYPE,
    H_ORIGINAL_ID,
    MAX_HEADER_BYTES,
    Message,
    WireMessage,
    epoch_time,
    from_wire,
    is_json_media_type,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)


def wire(body: bytes = b"{}", **overrides: Any) -> WireMessage:
    values: dict[str, Any] = {
        "exchange": "commands",
        "routing_key": "billing.invoice.create",
        "body": body,
        "message_id": str(uuid.uuid4()),
        "content_type": None,
    }
    values.update(overrides)
    return WireMessage(**values)


# --- timestamps ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        int(NOW.timestamp()),  # seconds, as the AMQP spec says
        int(NOW.timestamp() * 1000),  # milliseconds: JavaScript's Date.now()
        int(NOW.timestamp() * 1_000_000),  # microseconds
        int(NOW.timestamp() * 1_000_000_000),  # nanoseconds
    ],
)
def test_a_timestamp_in_any_common_unit_is_recognised(value: int) -> None:
    row = from_wire(wire(timestamp=value))
    assert abs((row["created_at"] - NOW).total_seconds()) < 1


@pytest.mark.parametrize("value", [0, 2**64 - 1, 10**19])
def test_a_timestamp_that_is_no_time_is_ignored_never_fatal(value: int) -> None:
    row = from_wire(wire(timestamp=value))
    assert row["created_at"] is None or row["created_at"].year <= 9999


def test_epoch_time_tells_units_apart_by_size() -> None:
    assert epoch_time(1) == datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert epoch_time(10**11) == datetime(1973, 3, 3, 9, 46, 40, tzinfo=UTC)  # ms
    assert epoch_time(-5) is None
    assert epoch_time(True) is None


def test_x_created_at_may_be_iso_or_epoch_and_is_kept_in_utc() -> None:
    row = from_wire(wire(headers={"x-created-at": "2026-03-01T14:00:00.123+02:00"}))
    assert row["created_at"] == NOW
    assert row["created_at"].tzinfo is not None
    row = from_wire(wire(headers={"x-created-at": int(NOW.timestamp() * 1000)}))
    assert abs((row["created_at"] - NOW).total_seconds()) < 1


def test_a_time_that_leaves_pythons_range_in_utc_is_refused() -> None:
    with pytest.raises(InvalidMessage, match="out of range"):
        from_wire(wire(headers={"x-expires-at": "9999-12-31T23:59:59-14:00"}))


# --- content type, encoding, body ------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "json"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON;charset=UTF-8", True),
        ("application/cloudevents+json", True),
        ("application/vnd.acme.order+json; version=2", True),
        ("application/jsonx", False),
        ("application/json-seq", False),
        ("text/json", False),
        ("text/plain", False),
        ("application/+json", True),
    ],
)
def test_json_media_types(content_type: str, json: bool) -> None:
    assert is_json_media_type(content_type) is json
    if json:
        assert from_wire(wire(content_type=content_type))["payload"] == {}
    else:
        with pytest.raises(InvalidMessage, match="not JSON"):
            from_wire(wire(content_type=content_type))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"a": "\\u0000"}', "U\\+0000"),
        (b'{"\\u0000": 1}', "U\\+0000"),
        (b'["\\ud800"]', "unpaired surrogate"),
        (b'["\\udc00x"]', "unpaired surrogate"),
        (b"NaN", "not JSON"),
        (b'{"a": Infinity}', "not JSON"),
        (b"[1e400]", "out of range"),
        (b"[" * 300 + b"]" * 300, "nested deeper"),
        (b"[" * 5000 + b"]" * 5000, "nested deeper"),
        (b"\xff", "not UTF-8"),
        (b"", "not JSON"),
    ],
)
def test_bodies_postgresql_cannot_store_are_refused(body: bytes, reason: str) -> None:
    with pytest.raises(InvalidMessage, match=reason):
        from_wire(wire(body))


def test_bodies_near_the_rules_are_accepted() -> None:
    assert from_wire(wire(b'["\\ud83d\\ude00", "\\\\u0000"]'))["payload"] == ["😀", "\\u0000"]
    assert from_wire(wire(b"\xef\xbb\xbf[1]"))["payload"] == [1]  # a byte order mark
    assert from_wire(wire(b"[" * 256 + b"]" * 256))["payload"] is not None
    assert from_wire(wire(b"[1.5e300, 12345678901234567890123]"))["payload"][1] > 10**22


def test_body_over_the_limit_is_refused() -> None:
    with pytest.raises(InvalidMessage, match="over the limit of 10"):
        from_wire(wire(b"[1,2,3,4,5,6]"), max_bytes=10)
    assert from_wire(wire(b"[1,2,3,4]"), max_bytes=10)["payload"] == [1, 2, 3, 4]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "base64"])
def test_a_compressed_body_is_refused(encoding: str) -> None:
    with pytest.raises(InvalidMessage, match="content encoding"):
        from_wire(wire(properties={"content_encoding": encoding}))
    assert from_wire(wire(properties={"content_encoding": "UTF-8"}))["payload"] == {}


# --- properties and headers ------------------------------------------------------------------


def test_the_routing_key_chooses_the_handler_and_type_is_kept_as_information() -> None:
    row = from_wire(wire(type="CreateInvoiceCommand"))
    assert row["routing_key"] == "billing.invoice.create"
    assert row["headers"][H_AMQP_TYPE] == "CreateInvoiceCommand"
    # The library's own messages put the routing key in `type`: nothing extra is kept.
    assert H_AMQP_TYPE not in from_wire(wire(type="billing.invoice.create"))["headers"]


def test_the_original_route_counts_only_for_a_message_back_from_a_delay_tier() -> None:
    spoofed = {"x-original-routing-key": "billing.invoice.void", "x-original-exchange": "events"}
    assert from_wire(wire(headers=spoofed))["routing_key"] == "billing.invoice.create"
    back = from_wire(wire(exchange="retry", routing_key="billing", headers=spoofed))
    assert (back["routing_key"], back["kind"]) == ("billing.invoice.void", "event")


def test_a_foreign_id_is_keyed_by_uuid5_and_correlates_as_written() -> None:
    row = from_wire(wire(message_id="cmd-42"))
    assert row["message_id"] == uuid.uuid5(FOREIGN_ID_NAMESPACE, "cmd-42")
    assert row["headers"][H_ORIGINAL_ID] == "cmd-42"
    assert row["correlation_id"] == "cmd-42"  # no correlation_id: it starts a conversation
    assert from_wire(wire(message_id="cmd-42", correlation_id="c-1"))["correlation_id"] == "c-1"
    # A sender cannot make up an original id for a UUID.
    plain = from_wire(wire(headers={H_ORIGINAL_ID: "forged"}))
    assert H_ORIGINAL_ID not in plain["headers"]


def test_what_a_handler_sends_names_the_original_id() -> None:
    foreign = Message(
        message_id=uuid.uuid5(FOREIGN_ID_NAMESPACE, "cmd-42"),
        type="billing.invoice.create",
        payload={},
        headers={H_ORIGINAL_ID: "cmd-42"},
    )
    assert foreign.original_id == "cmd-42"
    mine = Message(message_id=uuid.uuid4(), type="a.b", payload={})
    assert mine.original_id == str(mine.message_id)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"message_id": b"\xff\xfe"}, "message_id is not UTF-8"),
        ({"message_id": ""}, "no message_id"),
        ({"message_id": None}, "no message_id"),
        ({"message_id": "m\x00"}, "message_id holds the character U\\+0000"),
        ({"headers": {"x-version": "²"}}, "x-version"),
        ({"headers": {"x-created-at": "²"}}, "ISO 8601"),
        ({"correlation_id": b"\xff"}, "correlation_id is not UTF-8"),
        ({"routing_key": b"billing.\xff"}, "routing key is not UTF-8"),
        ({"routing_key": "billing.a\x00b"}, "U\\+0000"),
        ({"priority": 300}, "0..255"),
        ({"priority": -1}, "0..255"),
        ({"priority": "high"}, "0..255"),
        ({"headers": {"x-version": 2**40}}, "x-version"),
        ({"headers": {"x-version": "two"}}, "x-version"),
        ({"headers": {"x-version": 0}}, "x-version"),
        ({"headers": {"x-version": True}}, "x-version"),
        ({"headers": {"x-key": "k" * 256}}, "longer than 255"),
        ({"headers": {"x-causation-id": "c" * 256}}, "longer than 255"),
        ({"headers": {"x-tenant": "t" * 256}}, "x-tenant is longer than 255"),
        ({"headers": {"x-tenant": "a\x00b"}}, "x-tenant holds the character U\\+0000"),
        ({"headers": {"x-kind": "query"}}, "command or event"),
        ({"headers": {"x-created-at": "soon"}}, "ISO 8601"),
        ({"headers": {"x-expires-at": b"\xff"}}, "not UTF-8"),
        ({"headers": {"tenant": "a\x00b"}}, "U\\+0000"),
        ({"headers": {"a\x00": 1}}, "U\\+0000"),
        ({"headers": {"big": "x" * (MAX_HEADER_BYTES + 1)}}, "over 65536"),
        ({"headers": "not a table"}, "not a table"),
    ],
)
def test_each_broken_rule_is_refused_with_its_reason(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(InvalidMessage, match=reason):
        from_wire(wire(**overrides))


def test_liberal_where_it_is_safe() -> None:
    row = from_wire(
        wire(
            app_id=b"caf\xe9\x00",  # informational: what cannot be stored is replaced
            type=b"\xff\x00",
            headers={
                "x-kind": "Event",
                "x-version": "3",
                "x-key": "",
                "x-tenant": 42,
                "price": float("nan"),
                b"\xffname": decimal.Decimal("1.5"),
                "when": NOW,
            },
        )
    )
    assert row["source"] == "caf\ufffd\ufffd"
    assert row["headers"][H_AMQP_TYPE] == "\ufffd\ufffd"
    assert row["kind"] == "event"
    assert row["version"] == 3
    assert row["key"] is None
    assert (row["tenant"], "x-tenant" in row["headers"]) == ("42", False)
    assert row["headers"]["price"] == "nan"
    assert row["headers"]["\ufffdname"] == "1.5"
    assert row["headers"]["when"] == NOW.isoformat()


# --- the AMQP codec --------------------------------------------------------------------------


def _properties(headers: bytes, **short: Any) -> bytes:
    return amqp_raw.encode_properties({"headers": headers, **short})


def test_values_pika_cannot_represent_are_decoded_and_encode_back_to_the_same_bytes() -> None:
    entries = [
        ("ms", amqp_raw.timestamp(1_700_000_000_000)),
        ("max", amqp_raw.timestamp(2**64 - 1)),
        ("ok", amqp_raw.timestamp(1_700_000_000)),
        ("latin1", amqp_raw.long_string(b"caf\xe9")),
        ("deep", amqp_raw.nested_arrays(MAX_DEPTH + 5)),
        ("price", amqp_raw.double(1.5)),
        ("ratio", amqp_raw.float32(0.25)),
        ("dec", amqp_raw.decimal_value(2, -12345)),
        ("bytes", amqp_raw.byte_array(b"\x00\x01")),
        ("small", amqp_raw.integer(b"b", -3)),
        ("big", amqp_raw.integer(b"l", 2**40)),
        ("none", amqp_raw.VOID),
        ("yes", amqp_raw.boolean(True)),
        ("table", amqp_raw.table([("a", amqp_raw.integer(b"I", 1))])),
    ]
    data = _properties(amqp_raw.table_body(entries), message_id=b"\xff", type="T")
    props = decode_properties(data)
    headers = props.headers
    assert str(headers["ms"]) == "1700000000000"
    assert isinstance(headers["max"], RawField)
    assert headers["ok"] == datetime.fromtimestamp(1_700_000_000, UTC)
    assert str(headers["latin1"]) == "caf\ufffd"
    assert headers["price"] == 1.5  # pika would give 1
    assert headers["ratio"] == 0.25
    assert headers["dec"] == decimal.Decimal("-123.45")
    assert headers["bytes"] == b"\x00\x01"
    assert headers["table"] == {"a": 1}
    assert props.message_id == b"\xff"
    depth = 0
    value = headers["deep"]
    while isinstance(value, list):
        (value,) = value
        depth += 1
    assert depth == MAX_DEPTH and isinstance(value, RawField)
    # Encoded again, every value decodes to what it was (widths of integers may differ).
    again = decode_properties(b"".join(encode_properties(props)))
    assert again.headers == headers
    assert again.message_id == b"\xff"
    row = from_wire(
        wire(message_id="m-1", headers=headers, timestamp=1_700_000_000_000),
    )
    assert row["headers"]["ms"] == "1700000000000"
    assert row["created_at"] == datetime.fromtimestamp(1_700_000_000, UTC)
    assert row["headers"]["bytes"] == "\ufffd\x01"  # binary: a lossy text, as before


def test_a_forwarded_copy_keeps_every_property_and_fits_in_its_frame() -> None:
    message = WireMessage(
        exchange="commands",
        routing_key="billing.x",
        body=b"{}",
        message_id="m-1",
        type="T",
        correlation_id="c",
        timestamp=5,
        priority=3,
        app_id="node",
        headers={"tenant": "acme", "price": 1.5},
        properties={"reply_to": "amq.rabbitmq.reply-to", "content_encoding": "utf-8"},
    )
    props = forward_properties(message, {"x-dead-reason": "invalid: x"}, max_size=4096)
    decoded = decode_properties(b"".join(props.encode()))
    assert decoded.reply_to == "amq.rabbitmq.reply-to"
    assert decoded.content_encoding == "utf-8"
    assert decoded.delivery_mode == 2
    assert (decoded.message_id, decoded.type, decoded.correlation_id) == ("m-1", "T", "c")
    assert (decoded.timestamp, decoded.priority, decoded.app_id) == (5, 3, "node")
    assert decoded.headers == {
        "tenant": "acme",
        "price": 1.5,
        "x-original-exchange": "commands",
        "x-original-routing-key": "billing.x",
        "x-dead-reason": "invalid: x",
    }
    huge = WireMessage(
        exchange="commands",
        routing_key="billing.x",
        body=b"{}",
        message_id="m-2",
        headers={"blob": "x" * 5000},
    )
    props = forward_properties(huge, {"x-dead-reason": "invalid: big"}, max_size=4096)
    encoded = b"".join(props.encode())
    assert len(encoded) <= 4096
    headers = decode_properties(encoded).headers
    assert "blob" not in headers
    assert headers["x-dead-reason"] == "invalid: big"
    assert headers["x-original-routing-key"] == "billing.x"
    assert "did not fit" in headers[amqp_fields.H_DROPPED_HEADERS]


def test_every_python_value_encodes() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    pieces: list[bytes] = []
    amqp_fields.encode_table(
        pieces,
        {
            "odd": Odd(),
            "huge": 2**70,
            "dec": decimal.Decimal("1E+5"),
            "precise": decimal.Decimal("3.141592653589793238"),
            "naive": datetime(2026, 1, 1),
            "old": datetime(1, 1, 1, tzinfo=UTC),
            "tuple": (1, "a"),
            "nan": decimal.Decimal("NaN"),
        },
    )
    data = b"".join(pieces)
    table, end = amqp_fields.decode_table(data, 0)
    assert end == len(data)
    assert table["odd"] == "odd"
    assert table["huge"] == str(2**70)
    assert table["dec"] == decimal.Decimal("100000")
    assert table["precise"] == "3.141592653589793238"
    assert table["naive"] == datetime(2026, 1, 1, tzinfo=UTC)
    assert table["tuple"] == [1, "a"]


def test_unknown_field_types_are_an_error_rabbitmq_never_lets_through() -> None:
    with pytest.raises(ValueError, match="unknown AMQP field type"):
        amqp_fields.decode_value(b"Z", 0)


def test_struct_sizes_match_the_spec() -> None:
    assert amqp_raw.timestamp(1)[1:] == struct.pack(">Q", 1)
