"""No single message can stop the pipe: what foreign senders put on the wire, one case at a time.

Each test publishes the odd message with raw AMQP bytes (tests/amqp_raw.py), then a valid
command, to a real RabbitMQ; the service's real receiver and worker run in threads against a
real PostgreSQL. The odd message must end stored or in ``billing.dead_letter`` with its reason
within seconds, and the valid one after it must be handled.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import amqp_raw
import pika
import pytest
from sqlalchemy import text

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import Message, Service
from outbox_inbox.brokers.amqp_fields import H_DROPPED_HEADERS, decode_leniently

INBOX_COUNT = "SELECT count(*) FROM outbox_inbox.inbox_messages"


@pytest.fixture
def billing(db_url: str, mq_url: str) -> Iterator[Service]:
    service = make_service("billing", db_url, mq_url, max_redeliveries=2)
    handled: list[Any] = []

    @service.on_command("ping")
    def ping(message: Message, session: Any) -> None:
        handled.append(message.payload)

    @service.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
            {"m": str(message.message_id), "t": message.type, "i": json.dumps(message.payload)},
        )

    service.handled = handled  # type: ignore[attr-defined,unused-ignore]
    service.declare_topology()
    try:
        yield service
    finally:
        service.close()


@pytest.fixture
def publisher(mq_url: str) -> Iterator[amqp_raw.RawPublisher]:
    raw = amqp_raw.RawPublisher(mq_url)
    try:
        yield raw
    finally:
        raw.close()


def _ping(publisher: amqp_raw.RawPublisher, n: int) -> None:
    props = {"message_id": str(uuid.uuid4()), "content_type": "application/json"}
    assert publisher.publish("commands", "billing.ping", json.dumps({"n": n}).encode(), props)


def _pinged(service: Service, n: int, timeout: float = 10.0) -> None:
    handled: list[Any] = service.handled  # type: ignore[attr-defined]
    wait_until(lambda: {"n": n} in handled, timeout=timeout, what=f"ping {n} handled")


def dead_letters(mq_url: str) -> list[tuple[Any, bytes]]:
    """Take every message in billing.dead_letter, decoded as the receiver decodes."""
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


def _reason(props: Any) -> str:
    return str(props.headers["x-dead-reason"])


def test_a_timestamp_in_milliseconds_is_recognised_and_the_pipe_flows(
    billing: Service, publisher: amqp_raw.RawPublisher, db_url: str
) -> None:
    now = datetime.now(UTC)
    millis = int(now.timestamp() * 1000)  # what Date.now() gives a JavaScript sender
    headers = amqp_raw.table_body([("sent-at", amqp_raw.timestamp(millis))])
    props = {"message_id": "js-1", "timestamp": millis, "headers": headers}
    assert publisher.publish("commands", "billing.invoice.create", b'{"n": 1}', props)
    _ping(publisher, 1)
    started = time.monotonic()
    with running(billing.receiver(), billing.worker()):
        _pinged(billing, 1)
    assert time.monotonic() - started < 10
    [(created_at, sent_at)] = rows(
        db_url,
        "SELECT created_at, headers->>'sent-at' FROM outbox_inbox.inbox_messages"
        " WHERE headers->>'x-original-message-id' = 'js-1'",
    )
    assert abs((created_at - now).total_seconds()) < 1
    assert sent_at == str(millis)  # a header timestamp past the year 9999 is kept as a number
    assert scalar(db_url, "SELECT count(*) FROM effects") == 1


def test_a_u0000_string_is_dead_lettered_at_once_and_its_batch_is_stored(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str, db_url: str
) -> None:
    for n in range(3):
        props = {"message_id": f"ok-{n}"}
        assert publisher.publish("commands", "billing.invoice.create", b"{}", props)
        if n == 1:
            bad = {"message_id": "bad-1", "content_type": "application/json"}
            body = b'{"note": "a\\u0000b"}'
            assert publisher.publish("commands", "billing.invoice.create", body, bad)
    _ping(publisher, 1)
    receiver = billing.receiver()
    started = time.monotonic()
    with running(receiver, billing.worker()):
        _pinged(billing, 1)
        wait_until(lambda: receiver.dead == 1, timeout=5, what="the dead letter")
    assert time.monotonic() - started < 10
    assert receiver.delayed == 0  # no tour of the delay tiers
    assert scalar(db_url, INBOX_COUNT) == 4
    [(props, body)] = dead_letters(mq_url)
    assert props.message_id == "bad-1"
    assert _reason(props).startswith("invalid: body holds U+0000")
    assert props.content_type == "application/json"
    assert props.headers["x-original-routing-key"] == "billing.invoice.create"
    assert body == b'{"note": "a\\u0000b"}'


def test_a_body_over_max_message_bytes_is_dead_lettered_whole(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str, db_url: str
) -> None:
    big = json.dumps({"blob": "x" * (10 * 1024 * 1024)}).encode()
    headers = amqp_raw.table_body([("tenant", amqp_raw.long_string("acme"))])
    props = {"message_id": "big-1", "headers": headers, "reply_to": "replies"}
    assert publisher.publish("commands", "billing.invoice.create", big, props)
    _ping(publisher, 1)
    receiver = billing.receiver()
    with running(receiver, billing.worker()):
        _pinged(billing, 1, timeout=20)
        wait_until(lambda: receiver.dead == 1, timeout=5, what="the dead letter")
    [(props, body)] = dead_letters(mq_url)
    assert _reason(props) == (
        f"invalid: body is {len(big)} bytes, over the limit of 1048576 (max_message_bytes)"
    )
    assert body == big
    assert props.headers["tenant"] == "acme"
    assert props.reply_to == "replies"
    assert scalar(db_url, INBOX_COUNT) == 1


def test_a_class_name_in_type_is_handled_by_the_routing_key(
    billing: Service, publisher: amqp_raw.RawPublisher, db_url: str
) -> None:
    props = {"message_id": "cmd-7", "type": "CreateInvoiceCommand"}
    assert publisher.publish("commands", "billing.invoice.create", b'{"order": 7}', props)
    worker = billing.worker()
    with running(billing.receiver(), worker):
        wait_until(lambda: worker.processed == 1, timeout=10, what="the command handled")
    assert rows(db_url, "SELECT type, info FROM effects") == [
        ("billing.invoice.create", '{"order": 7}')
    ]
    [(status, headers)] = rows(db_url, "SELECT status, headers FROM outbox_inbox.inbox_messages")
    assert status == "processed"
    assert headers["x-amqp-type"] == "CreateInvoiceCommand"


def test_headers_pika_cannot_decode_do_not_stall_the_receiver(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str, db_url: str
) -> None:
    odd = [
        ("far", amqp_raw.timestamp(2**64 - 1)),
        ("deep", amqp_raw.nested_arrays(3000)),
        ("price", amqp_raw.double(12.75)),
        ("latin1", amqp_raw.long_string(b"caf\xe9")),
    ]
    headers = amqp_raw.table_body(odd)
    assert publisher.publish(
        "commands", "billing.invoice.create", b"[]", {"message_id": "odd-1", "headers": headers}
    )
    # The same headers on a message that breaks a rule: its dead letter keeps them all.
    bad = {"message_id": "odd-2", "headers": headers, "content_type": "text/xml"}
    assert publisher.publish("commands", "billing.invoice.create", b"<x/>", bad)
    _ping(publisher, 1)
    receiver = billing.receiver()
    with running(receiver, billing.worker()):
        _pinged(billing, 1)
        wait_until(lambda: receiver.dead == 1, timeout=5, what="the dead letter")
    [(stored,)] = rows(
        db_url,
        "SELECT headers FROM outbox_inbox.inbox_messages"
        " WHERE headers->>'x-original-message-id' = 'odd-1'",
    )
    assert stored["far"] == str(2**64 - 1)
    assert stored["price"] == 12.75
    assert stored["latin1"] == "caf\ufffd"
    assert "nested deeper" in json.dumps(stored["deep"])
    [(props, _body)] = dead_letters(mq_url)
    assert _reason(props) == "invalid: content type 'text/xml' is not JSON"
    assert str(props.headers["far"]) == str(2**64 - 1)
    assert props.headers["price"] == 12.75
    assert str(props.headers["latin1"]) == "caf\ufffd"


def test_headers_too_large_to_forward_are_dropped_from_the_dead_letter_only(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str
) -> None:
    # Nearly a whole frame (131072 bytes) of headers: no room for the dead-letter headers.
    blob = amqp_raw.long_string("x" * 131_000)
    props = {"message_id": "huge-1", "headers": amqp_raw.table_body([("blob", blob)])}
    assert publisher.publish("commands", "billing.invoice.create", b"{}", props)
    _ping(publisher, 1)
    receiver = billing.receiver()
    with running(receiver, billing.worker()):
        _pinged(billing, 1)
        wait_until(lambda: receiver.dead == 1, timeout=5, what="the dead letter")
    [(props, body)] = dead_letters(mq_url)
    assert _reason(props).startswith("invalid: headers are")
    assert "blob" not in props.headers
    assert "did not fit" in props.headers[H_DROPPED_HEADERS]
    assert props.message_id == "huge-1"
    assert body == b"{}"


def test_properties_that_are_not_utf8_are_dead_lettered_as_sent(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str
) -> None:
    props = {"message_id": b"id-\xff", "correlation_id": b"\xfe"}
    assert publisher.publish("commands", "billing.invoice.create", b"{}", props)
    assert publisher.publish("commands", b"billing.invoice.\xff", b"{}", {"message_id": "rk-1"})
    _ping(publisher, 1)
    receiver = billing.receiver()
    with running(receiver, billing.worker()):
        _pinged(billing, 1)
        wait_until(lambda: receiver.dead == 2, timeout=5, what="2 dead letters")
    (first, _), (second, _) = dead_letters(mq_url)
    assert first.message_id == b"id-\xff"
    assert _reason(first) == "invalid: message_id is not UTF-8 text"
    assert first.correlation_id == b"\xfe"
    assert _reason(second) == "invalid: routing key is not UTF-8 text"
    assert second.headers["x-original-routing-key"] == b"billing.invoice.\xff"


def test_a_row_the_database_refuses_is_dead_lettered_at_once_and_the_others_stored(
    billing: Service, publisher: amqp_raw.RawPublisher, mq_url: str, db_url: str
) -> None:
    with billing.engine.begin() as conn:  # a check decoding cannot know about
        conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " IF NEW.payload ? 'negative' THEN"
                "  RAISE EXCEPTION 'amount must be positive' USING ERRCODE = '22023';"
                " END IF; RETURN NEW; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON outbox_inbox.inbox_messages"
                " FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    for n in range(5):
        body = b'{"negative": true}' if n == 2 else b"{}"
        assert publisher.publish(
            "commands", "billing.invoice.create", body, {"message_id": f"m-{n}"}
        )
    _ping(publisher, 1)
    receiver = billing.receiver()
    with running(receiver, billing.worker()):
        _pinged(billing, 1)
        wait_until(lambda: receiver.dead == 1, timeout=5, what="the dead letter")
    assert receiver.delayed == 0
    assert scalar(db_url, INBOX_COUNT) == 5
    [(props, _body)] = dead_letters(mq_url)
    assert props.message_id == "m-2"
    assert _reason(props).startswith("invalid: the database refused it:")
    assert "amount must be positive" in _reason(props)


def test_a_reply_carries_the_senders_own_id_as_causation_and_correlation(
    billing: Service, publisher: amqp_raw.RawPublisher, db_url: str
) -> None:
    @billing.on_command("quote.request")
    def quote(message: Message, session: Any) -> None:
        billing.outbox.publish(session, "quote.given", {"price": 10})

    billing.declare_topology()
    assert publisher.publish("commands", "billing.quote.request", b"{}", {"message_id": "q-1"})
    worker = billing.worker()
    with running(billing.receiver(), worker):
        wait_until(lambda: worker.processed == 1, timeout=10)
    assert rows(
        db_url, "SELECT causation_id, correlation_id FROM outbox_inbox.outbox_messages"
    ) == [("q-1", "q-1")]
