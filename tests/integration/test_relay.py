"""The relay publishes committed rows with confirms and marks them only after the confirm."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest
from sqlalchemy import text

from helpers import drain, make_service, scalar, wait_until
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.topology import Binding, Exchange, Queue, Topology


def _declare_probe(mq_url: str, queue: str, exchange: str, pattern: str) -> None:
    RabbitMQBroker(mq_url).declare(
        Topology(
            exchanges=(Exchange(exchange, "topic"),),
            queues=(Queue(queue),),
            bindings=(Binding(exchange, queue, pattern),),
        )
    )


def test_relay_publishes_persistent_messages_and_marks_them_after_confirm(
    db_url: str, mq_url: str
) -> None:
    svc = make_service("orders", db_url, mq_url)
    svc.declare_topology()
    _declare_probe(mq_url, "probe", "events", "orders.#")
    with svc.session() as session, session.begin():
        ids = [svc.outbox.publish(session, "order.placed", {"n": n}) for n in range(30)]
    relay = svc.relay()
    assert relay.relay_once() == 30
    assert (
        scalar(
            db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"
        )
        == 0
    )
    got = drain(mq_url, "probe")
    assert [uuid.UUID(p.message_id) for p, _ in got] == ids
    props = got[0][0]
    assert props.delivery_mode == 2
    assert props.content_type == "application/json"
    assert props.app_id == "orders"
    assert props.type == "orders.order.placed"
    assert relay.relay_once() == 0  # nothing is sent twice
    svc.close()


def test_broker_down_keeps_rows_unpublished_and_relay_recovers(db_url: str) -> None:
    svc = make_service("orders", db_url, "amqp://guest:guest@127.0.0.1:1/%2F")
    with svc.session() as session, session.begin():
        svc.outbox.publish(session, "order.placed", {"n": 1})
    from outbox_inbox import BrokerConnectionError

    with pytest.raises(BrokerConnectionError, match=r"127\.0\.0\.1:1"):
        svc.relay().relay_once()
    assert (
        scalar(
            db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"
        )
        == 1
    )
    svc.close()


def test_command_to_a_service_without_queue_is_kept_in_unroutable(db_url: str, mq_url: str) -> None:
    svc = make_service("orders", db_url, mq_url)
    svc.declare_topology()
    with svc.session() as session, session.begin():
        command_id = svc.outbox.send(session, "nobody", "thing.do", {"x": 1})
        svc.outbox.publish(session, "order.nobody.listens", {"x": 2})
    assert svc.relay().relay_once() == 2
    # Both count as published: the command sits in `unroutable`, the event had no subscriber.
    assert (
        scalar(
            db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"
        )
        == 0
    )
    kept = drain(mq_url, "unroutable")
    assert [uuid.UUID(p.message_id) for p, _ in kept] == [command_id]
    svc.close()


def test_commands_waiting_in_unroutable_are_logged_and_counted_as_dead_letters(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    svc = make_service("orders", db_url, mq_url, maintenance_interval=0.2)
    svc.declare_topology()
    drain(mq_url, "unroutable")  # shared by every service: start from an empty queue
    with svc.session() as session, session.begin():
        svc.outbox.send(session, "nobody", "thing.do", {"x": 1})
    caplog.set_level(logging.WARNING, logger="outbox_inbox.service")
    svc.start(receiver=False, workers=0)
    try:
        wait_until(lambda: [r for r in caplog.records if "unroutable" in r.getMessage()])
        health = svc.health(max_dead=0)
    finally:
        svc.stop()
    [warned] = [r.getMessage() for r in caplog.records if "unroutable" in r.getMessage()]
    assert warned.startswith("1 command(s) wait in the queue unroutable")
    assert "1 dead letter exceeds --max-dead 0" in health.problems
    drain(mq_url, "unroutable")
    svc.close()


def test_rows_of_one_key_are_published_in_order_and_a_failed_head_holds_its_key(
    db_url: str, mq_url: str
) -> None:
    svc = make_service("orders", db_url, mq_url)
    svc.declare_topology()
    _declare_probe(mq_url, "probe", "events", "orders.#")
    with svc.session() as session, session.begin():
        for n in range(5):
            svc.outbox.publish(session, "order.changed", {"n": n}, key="order-1")
            svc.outbox.publish(session, "order.changed", {"n": n}, key="order-2")
    # The head of order-1 failed before and waits for its retry.
    with svc.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox_inbox.outbox_messages SET available_at = now() + interval '1 hour'"
                " WHERE id = (SELECT min(id) FROM outbox_inbox.outbox_messages"
                " WHERE key = 'order-1')"
            )
        )
    svc.relay().relay_once()
    import json

    got = [(p.headers["x-key"], json.loads(b)["n"]) for p, b in drain(mq_url, "probe")]
    assert got == [("order-2", n) for n in range(5)]
    held = scalar(
        db_url,
        "SELECT count(*) FROM outbox_inbox.outbox_messages"
        " WHERE key = 'order-1' AND published_at IS NULL",
    )
    assert held == 5
    svc.close()


def test_relay_wakes_on_notify_after_commit(db_url: str, mq_url: str) -> None:
    svc = make_service("orders", db_url, mq_url, relay_poll_interval=30)
    svc.declare_topology()
    stop = threading.Event()
    relay = svc.relay()
    started = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), kwargs={"on_started": started.set})
    thread.start()
    try:
        started.wait(5)
        wait_until(
            lambda: scalar(
                db_url, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
            ),
            what="LISTEN",
        )
        with svc.session() as session, session.begin():
            svc.outbox.publish(session, "order.placed", {"n": 1})
        # Far sooner than the 30 s poll interval.
        wait_until(lambda: relay.published == 1, timeout=5, what="relay to wake on NOTIFY")
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    svc.close()


def test_two_relays_publish_every_row_once(db_url: str, mq_url: str) -> None:
    svc = make_service("orders", db_url, mq_url, relay_batch_size=50)
    svc.declare_topology()
    _declare_probe(mq_url, "probe", "events", "orders.#")
    with svc.session() as session, session.begin():
        for n in range(1000):
            svc.outbox.publish(session, "order.placed", {"n": n}, key=f"k{n % 7}")
    stop = threading.Event()
    relays = [svc.relay(), svc.relay()]
    threads = [threading.Thread(target=r.run, args=(stop,)) for r in relays]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sum(r.published for r in relays) >= 1000, timeout=30)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    import json

    got = [(p.headers["x-key"], json.loads(b)["n"]) for p, b in drain(mq_url, "probe")]
    assert sorted(n for _, n in got) == list(range(1000))
    for key in {k for k, _ in got}:
        seq = [n for k, n in got if k == key]
        assert seq == sorted(seq), f"key {key} out of order"
    svc.close()
