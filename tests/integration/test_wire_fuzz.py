"""Property-based: whatever a sender puts on the wire, the receiver keeps going.

Hypothesis makes batches of messages with arbitrary AMQP properties, header tables (every
field type, values pika cannot represent, names the library reserves) and bodies, and
publishes them as raw bytes to a real RabbitMQ; the service's real receiver and worker run in
threads against a real PostgreSQL. After each batch a valid command is sent, and once it is
handled:

* every message of the batch has ended: stored in the inbox, or in ``billing.dead_letter``
  with an ``x-dead-reason``, nothing in a delay tier, nothing left in the queue;
* each dead letter keeps the properties and headers it was sent with;
* the receiver never failed, reconnected or retried (no warning of its own).
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from typing import Any

import amqp_raw
import pika
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import make_service, running, scalar, wait_until
from outbox_inbox import Message
from outbox_inbox.brokers.amqp_fields import decode_leniently, decode_table

LIMIT = 64 * 1024  # max_message_bytes of the service under test
RESERVED = [
    "x-kind",
    "x-version",
    "x-key",
    "x-causation-id",
    "x-created-at",
    "x-expires-at",
    "x-attempt",
    "x-original-message-id",
    "x-amqp-type",
    "x-original-exchange",
    "x-original-routing-key",
    "x-receive-attempt",
    "x-dead-reason",
    "x-death",
    "tenant",
]
TEXTS = [
    "command",
    "event",
    "Event",
    "query",
    "1",
    "0",
    "2147483648",
    "2026-01-01T00:00:00",
    "9999-12-31T23:59:59-14:00",
    "0001-01-01T00:00:00+14:00",
    "soon",
    "1700000000000",
    "k" * 300,
    "a\x00b",
]

short_bytes = st.binary(max_size=40)
names = st.one_of(st.sampled_from(RESERVED), st.binary(max_size=20))
leaves = st.one_of(
    st.binary(max_size=50).map(amqp_raw.long_string),
    st.text(max_size=30).map(lambda t: amqp_raw.long_string(t.encode("utf-8", "surrogatepass"))),
    st.sampled_from(TEXTS).map(amqp_raw.long_string),
    st.binary(max_size=20).map(amqp_raw.byte_array),
    st.integers(0, 2**64 - 1).map(amqp_raw.timestamp),
    st.floats(allow_nan=False, allow_infinity=False).map(amqp_raw.double),
    st.floats(width=32, allow_nan=False, allow_infinity=False).map(amqp_raw.float32),
    st.integers(-(2**7), 2**7 - 1).map(lambda v: amqp_raw.integer(b"b", v)),
    st.integers(0, 2**8 - 1).map(lambda v: amqp_raw.integer(b"B", v)),
    st.integers(-(2**15), 2**15 - 1).map(lambda v: amqp_raw.integer(b"s", v)),
    st.integers(0, 2**16 - 1).map(lambda v: amqp_raw.integer(b"u", v)),
    st.integers(-(2**31), 2**31 - 1).map(lambda v: amqp_raw.integer(b"I", v)),
    st.integers(0, 2**32 - 1).map(lambda v: amqp_raw.integer(b"i", v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: amqp_raw.integer(b"l", v)),
    st.tuples(st.integers(0, 255), st.integers(-(2**31), 2**31 - 1)).map(
        lambda t: amqp_raw.decimal_value(*t)
    ),
    st.booleans().map(amqp_raw.boolean),
    st.just(amqp_raw.VOID),
    st.integers(30, 2000).map(amqp_raw.nested_arrays),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(amqp_raw.array),
        st.lists(st.tuples(names, inner), max_size=4).map(amqp_raw.table),
    ),
    max_leaves=12,
)
headers = st.lists(st.tuples(names, values), max_size=8).map(amqp_raw.table_body)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=15,
)
bodies = st.one_of(
    st.tuples(json_values, st.booleans()).map(
        lambda v: json.dumps(v[0], ensure_ascii=v[1]).encode("utf-8", "surrogatepass")
    ),
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"NaN",
            b"[1e400]",
            b"[" * 300 + b"]" * 300,
            b"",
            b"\xef\xbb\xbf{}",
            b'{"a": "\\u0000"}',
            b'["\\ud800"]',
            b"[" + b"0," * (LIMIT // 2) + b"0]",  # over max_message_bytes
        ]
    ),
)
#: A message id: absent, or made unique when sent (its kind and a fuzzed suffix).
message_ids = st.one_of(
    st.none(),
    st.tuples(st.sampled_from(["text", "bytes", "uuid", "UUID", "{uuid}"]), st.binary(max_size=30)),
)
timestamps = st.one_of(
    st.none(),
    st.integers(0, 2**64 - 1),
    st.sampled_from([1_700_000_000, 1_700_000_000_000, 1_700_000_000_000_000, 2**63]),
)
messages = st.fixed_dictionaries(
    {
        "route": st.tuples(st.sampled_from(["commands", "events"]), st.binary(max_size=30)),
        "body": bodies,
        "message_id": message_ids,
        "content_type": st.one_of(
            st.none(),
            st.sampled_from(
                [
                    "application/json",
                    "application/json; charset=utf-8",
                    "application/cloudevents+json",
                    "application/jsonx",
                    "text/plain",
                    "",
                ]
            ),
            short_bytes,
        ),
        "content_encoding": st.one_of(
            st.none(), st.sampled_from(["utf-8", "gzip", "identity", ""]), short_bytes
        ),
        "headers": st.one_of(st.none(), headers),
        "delivery_mode": st.one_of(st.none(), st.sampled_from([1, 2])),
        "priority": st.one_of(st.none(), st.integers(0, 255)),
        "correlation_id": st.one_of(
            st.none(),
            st.binary(max_size=255),
            st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
        ),
        "reply_to": st.one_of(st.none(), short_bytes),
        "timestamp": timestamps,
        "type": st.one_of(st.none(), short_bytes, st.sampled_from(["CreateInvoice"])),
        "app_id": st.one_of(st.none(), short_bytes),
        "cluster_id": st.one_of(st.none(), st.binary(max_size=20)),
    }
)

_serial = itertools.count(1)


def _message_id(template: tuple[str, bytes] | None) -> str | bytes | None:
    if template is None:
        return None
    kind, suffix = template
    n = next(_serial)
    if kind == "text":
        return f"fuzz-{n}-".encode() + suffix.decode("utf-8", "replace").encode()[:200]
    if kind == "bytes":
        return f"fuzz-{n}-".encode() + suffix
    fresh = str(uuid.uuid4())
    return {"uuid": fresh, "UUID": fresh.upper(), "{uuid}": "{" + fresh + "}"}[kind]


def _route(route: tuple[str, bytes]) -> tuple[str, bytes]:
    exchange, suffix = route
    prefix = b"billing.fuzz." if exchange == "commands" else b"fuzz."
    return exchange, prefix + suffix


def _dead_letters(mq_url: str) -> list[tuple[Any, bytes]]:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    decode_leniently(connection)
    try:
        channel = connection.channel()
        got: list[tuple[Any, bytes]] = []
        while True:
            method, props, body = channel.basic_get("billing.dead_letter", auto_ack=True)
            if method is None:
                return got
            got.append((props, body))
    finally:
        connection.close()


_KEPT = (
    "message_id",
    "correlation_id",
    "type",
    "app_id",
    "content_type",
    "content_encoding",
    "timestamp",
    "priority",
    "reply_to",
    "cluster_id",
)
_ADDED = {"x-dead-reason", "x-dead-queue", "x-dead-fingerprint"}


def _as_received(value: Any) -> Any:
    """A short string as a receiver sees it: text when it is UTF-8, else its bytes."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def _sent_headers(raw: bytes | None) -> dict[Any, Any]:
    return decode_table(raw, 0)[0] if raw is not None else {}


def _check_dead_letters(sent: list[dict[str, Any]], dead: list[tuple[Any, bytes]]) -> None:
    """Each dead letter has a reason, and the properties and headers it was sent with."""
    remaining = iter(sent)
    for props, body in dead:
        reason = (props.headers or {}).get("x-dead-reason")
        assert isinstance(reason, str) and reason.startswith("invalid: "), reason
        for original in remaining:  # dead letters come in the order they were sent
            sent_id = _as_received(original["message_id"])
            if original["body"] == body and sent_id == props.message_id:
                break
        else:
            raise AssertionError(f"dead letter {props.message_id!r} matches no sent message")
        for name in _KEPT:
            assert getattr(props, name) == _as_received(original[name]), (name, reason)
        assert props.delivery_mode == 2
        got = dict(props.headers)
        expected = _sent_headers(original["headers"])
        for name in _ADDED:
            got.pop(name)
            expected.pop(name, None)
        exchange, routing_key = original["route"]
        assert got.pop("x-original-exchange") == expected.pop("x-original-exchange", exchange)
        assert got.pop("x-original-routing-key") == expected.pop(
            "x-original-routing-key", _as_received(routing_key)
        )
        assert got == expected, reason


def test_no_message_stops_the_receiver(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox_inbox.receiver")
    service = make_service("billing", db_url, mq_url, max_message_bytes=LIMIT)
    pings: list[int] = []

    @service.on_command("ping")
    def ping(message: Message, session: Any) -> None:
        pings.append(message.payload["n"])

    @service.on_event("fuzz.#")
    def event(message: Message, session: Any) -> None:
        pass

    service.declare_topology()
    publisher = amqp_raw.RawPublisher(mq_url)
    receiver = service.receiver()
    totals = {"sent": 0, "dead": 0, "refused_by_broker": 0}
    rounds = itertools.count(1)

    # One receiver and one queue serve every example, so examples are not independent: no
    # shrinking (a stalled queue fails every later example), the first failure is reported.
    @settings(
        max_examples=50,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=st.lists(messages, min_size=1, max_size=4))
    def check(batch: list[dict[str, Any]]) -> None:
        sent = []
        for fuzzed in batch:
            message = dict(fuzzed, message_id=_message_id(fuzzed["message_id"]))
            message["route"] = _route(message["route"])
            props = {k: v for k, v in message.items() if k not in ("route", "body")}
            exchange, routing_key = message["route"]
            if publisher.publish(exchange, routing_key, message["body"], props):
                sent.append(message)
            else:  # RabbitMQ itself refused it: never reached the receiver
                totals["refused_by_broker"] += 1
        totals["sent"] += len(sent)
        n = next(rounds)
        body = json.dumps({"n": n}).encode()
        assert publisher.publish(
            "commands", "billing.ping", body, {"message_id": str(uuid.uuid4())}
        )
        wait_until(lambda: n in pings, timeout=15, what=f"ping {n} handled")
        dead = _dead_letters(mq_url)
        totals["dead"] += len(dead)
        stored = scalar(
            db_url,
            "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE routing_key <> 'billing.ping'",
        )
        assert stored + totals["dead"] == totals["sent"]
        _check_dead_letters(sent, dead)

    try:
        with running(receiver, service.worker()):
            check()
            assert receiver.delayed == 0
            assert service.broker.queue_depth("billing.inbox") == 0
    finally:
        publisher.close()
        service.close()
    complaints = [
        r.getMessage()
        for r in caplog.records
        if r.name == "outbox_inbox.receiver" and "dead-lettering" not in r.getMessage()
    ]
    assert not complaints, complaints
    assert totals["sent"] > 0 and totals["dead"] > 0
