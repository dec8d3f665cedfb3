"""A message the broker refuses cannot stop the relay: it is isolated, retried and ends dead.

RabbitMQ's ``max_message_size`` is lowered at run time on the session's server (new channels
read it), so an oversized message is a 70 KiB one and the tests stay fast.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest

from helpers import drain, make_service, rows, wait_until
from outbox_inbox import Service
from outbox_inbox.relay import REFUSED_REASON
from outbox_inbox.status import collect_status
from outbox_inbox.topology import Binding, Exchange, Queue, Topology

LIMIT = 64 * 1024
BIG = {"blob": "x" * (LIMIT + 4096)}
REFUSAL_SETTINGS: dict[str, Any] = {
    "relay_retry_initial": 0.1,
    "relay_retry_max": 0.5,
    "relay_max_attempts": 3,
}


@pytest.fixture
def relaying() -> Iterator[Callable[[Service], None]]:
    """Runs a service's relay in a thread until the test ends."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(service: Service) -> None:
        started = threading.Event()
        relay = service.relay()
        thread = threading.Thread(
            target=relay.run, args=(stop,), kwargs={"on_started": started.set}, daemon=True
        )
        thread.start()
        threads.append(thread)
        assert started.wait(10)

    try:
        yield start
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=20)
            assert not thread.is_alive(), "the relay did not stop"


def _probe(mq_url: str) -> None:
    """A queue `probe` that every event of `orders` reaches."""
    from outbox_inbox.brokers.rabbitmq import RabbitMQBroker

    RabbitMQBroker(mq_url).declare(
        Topology(
            exchanges=(Exchange("events", "topic"),),
            queues=(Queue("probe"),),
            bindings=(Binding("events", "probe", "orders.#"),),
        )
    )


def _write_mixed_batch(svc: Service) -> dict[str, Any]:
    """Small unkeyed rows, an oversized row of key k1 with two rows of k1 after it, and a
    small key k2, all in one transaction."""
    with svc.session() as session, session.begin():
        before = [svc.outbox.publish(session, "order.small", {"n": n}) for n in range(5)]
        big = svc.outbox.publish(session, "order.big", BIG, key="k1")
        after_big = [
            svc.outbox.publish(session, "order.small", {"n": 10 + n}, key="k1") for n in range(2)
        ]
        other_key = [
            svc.outbox.publish(session, "order.small", {"n": 20 + n}, key="k2") for n in range(5)
        ]
        after = [svc.outbox.publish(session, "order.small", {"n": 30 + n}) for n in range(5)]
    return {
        "big": big,
        "after_big": after_big,
        "flowing": before + other_key + after,
    }


def _outbox_row(db_url: str, message_id: uuid.UUID) -> Any:
    [row] = rows(
        db_url,
        "SELECT published_at, dead_at, dead_reason, attempts, last_error, fingerprint"
        " FROM outbox_inbox.outbox_messages WHERE message_id = :m",
        m=message_id,
    )
    return row


def _received(mq_url: str, got: list[uuid.UUID]) -> list[uuid.UUID]:
    got.extend(uuid.UUID(p.message_id) for p, _ in drain(mq_url, "probe"))
    return got


def test_a_row_the_broker_refuses_mid_batch_is_found_alone_and_the_rows_around_it_flow(
    db_url: str,
    mq_url: str,
    rabbitmq_body_limit: Any,
    relaying: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The broker closes the channel over one message of a batch and says not which one.

    The relay's probe cannot see it coming: the relay runs with max_payload_bytes below the
    broker's limit, while the row was written by a process of the service configured with a
    larger max_payload_bytes (as during a rolling change of the setting).
    """
    caplog.set_level(logging.WARNING, logger="outbox_inbox.relay")
    rabbitmq_body_limit(LIMIT)
    writer = make_service("orders", db_url, mq_url)
    svc = make_service("orders", db_url, mq_url, max_payload_bytes=LIMIT // 2, **REFUSAL_SETTINGS)
    svc.declare_topology()
    _probe(mq_url)
    relaying(svc)
    ids = _write_mixed_batch(writer)

    got: list[uuid.UUID] = []
    wait_until(
        lambda: set(ids["flowing"]) <= set(_received(mq_url, got)),
        timeout=20,
        what="the small rows around the refused one to be published",
    )
    row = _outbox_row(db_url, ids["big"])
    assert row.published_at is None
    assert "PRECONDITION_FAILED" in row.last_error and str(LIMIT) in row.last_error

    wait_until(lambda: _outbox_row(db_url, ids["big"]).dead_at is not None, timeout=20)
    assert "in doubt one by one" in caplog.text
    row = _outbox_row(db_url, ids["big"])
    assert row.dead_reason == REFUSED_REASON
    assert row.fingerprint == "refused: 406 message larger than the broker's max_message_size"
    assert row.attempts == REFUSAL_SETTINGS["relay_max_attempts"]
    assert f"max size {LIMIT}" in row.last_error
    # The rows of its key waited for it and leave once it is dead, in their order.
    wait_until(lambda: set(ids["after_big"]) <= set(_received(mq_url, got)), timeout=20)
    assert [m for m in got if m in ids["after_big"]] == ids["after_big"]
    assert ids["big"] not in got
    status = collect_status(svc.engine, svc.tables, service="orders", admin=None)
    writer.close()
    assert status["outbox"]["dead"] == 1
    assert status["outbox"]["unpublished"] == 0
    svc.close()


def test_a_broker_limit_below_max_payload_bytes_is_reported_and_larger_rows_are_not_sent(
    db_url: str,
    mq_url: str,
    rabbitmq_body_limit: Any,
    relaying: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rabbitmq_body_limit(LIMIT)
    svc = make_service("orders", db_url, mq_url, **REFUSAL_SETTINGS)
    svc.declare_topology()
    _probe(mq_url)
    with caplog.at_level(logging.ERROR, logger="outbox_inbox.relay"):
        relaying(svc)
        wait_until(lambda: f"at most {LIMIT} bytes" in caplog.text, timeout=10)
    assert "max_payload_bytes=1048576" in caplog.text
    ids = _write_mixed_batch(svc)
    got: list[uuid.UUID] = []
    wait_until(
        lambda: set(ids["flowing"] + ids["after_big"]) <= set(_received(mq_url, got)),
        timeout=20,
    )
    row = _outbox_row(db_url, ids["big"])
    assert row.dead_reason == REFUSED_REASON
    assert "not sent" in row.last_error and f"max size {LIMIT}" in row.last_error
    assert ids["big"] not in got
    svc.close()


def test_rows_for_a_missing_exchange_wait_without_dying_while_commands_flow(
    db_url: str, mq_url: str, relaying: Any
) -> None:
    """A destination the broker refuses (404) is the broker's state, not the message's."""
    svc = make_service("orders", db_url, mq_url, **REFUSAL_SETTINGS)
    svc.declare_topology()
    relaying(svc)
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        connection.channel().exchange_delete("events")
    finally:
        connection.close()
    with svc.session() as session, session.begin():
        events = [svc.outbox.publish(session, "order.placed", {"n": n}) for n in range(3)]
        commands = [svc.outbox.send(session, "orders", "order.check", {"n": n}) for n in range(3)]
    wait_until(
        lambda: all(_outbox_row(db_url, c).published_at for c in commands),
        timeout=20,
        what="the commands to be published",
    )
    max_attempts = REFUSAL_SETTINGS["relay_max_attempts"]
    wait_until(
        lambda: all(_outbox_row(db_url, e).attempts > max_attempts for e in events),
        timeout=20,
        what="the events to be tried more than relay_max_attempts times",
    )
    for event in events:
        row = _outbox_row(db_url, event)
        assert row.dead_at is None and row.published_at is None
        assert "404" in row.last_error and "events" in row.last_error
    svc.declare_topology()  # the exchange is back: they leave
    wait_until(lambda: all(_outbox_row(db_url, e).published_at for e in events), timeout=20)
    assert collect_status(svc.engine, svc.tables, service="orders", admin=None)["outbox"] == {
        "unpublished": 0,
        "retrying": 0,
        "oldest_age_seconds": None,
        "dead": 0,
        "webhooks": [],
    }
    svc.close()
