"""The receiver stores each message once; the worker runs handlers in the marking transaction."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pika
from sqlalchemy import text

from helpers import make_service, publish_raw, rows, running, scalar, wait_until
from outbox_inbox import Message, Reject, RetryPolicy, Service


def _effect(session: Any, message: Message, info: str = "") -> None:
    session.execute(
        text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
        {"m": str(message.message_id), "t": message.type, "i": info},
    )


def test_duplicate_delivery_is_stored_once_and_acked(db_url: str, mq_url: str) -> None:
    svc = make_service("billing", db_url, mq_url)
    svc.declare_topology()
    message_id = str(uuid.uuid4())
    for _ in range(3):
        publish_raw(
            mq_url, "commands", "billing.invoice.create", b'{"n": 1}', message_id=message_id
        )
    receiver = svc.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored + receiver.duplicates >= 3, what="3 deliveries")
    assert receiver.stored == 1
    assert receiver.duplicates == 2
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 1
    assert svc.broker.queue_depth("billing.inbox") == 0
    # The dropped copies are counted for the audit (in one batch or later, the same).
    assert scalar(db_url, "SELECT duplicates FROM outbox_inbox.inbox_deliveries") == 2

    publish_raw(mq_url, "commands", "billing.invoice.create", b'{"n": 1}', message_id=message_id)
    with running(receiver):
        wait_until(lambda: receiver.duplicates == 3, what="the late copy")
    assert scalar(db_url, "SELECT duplicates FROM outbox_inbox.inbox_deliveries") == 3
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 1
    svc.close()


def test_subscriptions_are_recorded_once_with_the_time_of_their_first_recording(
    db_url: str, mq_url: str
) -> None:
    svc = make_service("billing", db_url, mq_url)
    svc.on_event("orders.order.*")(lambda message, session: None)
    svc.record_subscriptions()
    first = rows(
        db_url,
        "SELECT exchange, pattern, subscribed_at FROM outbox_inbox.subscriptions"
        " WHERE service = 'billing' ORDER BY exchange, pattern",
    )
    assert [(r.exchange, r.pattern) for r in first] == [
        ("commands", "billing.#"),
        ("events", "orders.order.*"),
    ]
    svc.record_subscriptions()
    assert (
        rows(
            db_url,
            "SELECT exchange, pattern, subscribed_at FROM outbox_inbox.subscriptions"
            " WHERE service = 'billing' ORDER BY exchange, pattern",
        )
        == first
    )
    svc.close()


def test_invalid_message_goes_to_dead_letter_with_its_reason(db_url: str, mq_url: str) -> None:
    svc = make_service("billing", db_url, mq_url)
    svc.declare_topology()
    publish_raw(mq_url, "commands", "billing.invoice.create", b"<xml/>", message_id="m-1")
    publish_raw(mq_url, "commands", "billing.invoice.create", b"{}")  # no message_id
    publish_raw(mq_url, "commands", "billing.invoice.create", b'{"ok": true}', message_id="m-2")
    receiver = svc.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == 1, what="the valid message")
        wait_until(
            lambda: svc.broker.queue_depth("billing.dead_letter") == 2,
            what="2 dead letters",
        )
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        reasons = []
        for _ in range(2):
            method, props, _body = channel.basic_get("billing.dead_letter", auto_ack=True)
            assert method is not None
            reasons.append(props.headers["x-dead-reason"])
    finally:
        connection.close()
    assert any("not JSON" in r for r in reasons)
    assert any("no message_id" in r for r in reasons)
    assert svc.broker.queue_depth("billing.inbox") == 0
    svc.close()


def _flow(db_url_factory: Any, mq_url: str, **settings: Any) -> tuple[Service, Service]:
    orders = make_service("orders", db_url_factory(), mq_url, **settings)
    billing = make_service("billing", db_url_factory(), mq_url, **settings)
    return orders, billing


def test_handler_effects_and_processed_mark_commit_together_and_failures_roll_back(
    db_url_factory: Any, mq_url: str
) -> None:
    orders, billing = _flow(db_url_factory, mq_url)
    calls: list[int] = []

    @billing.on_command("invoice.create", retry=RetryPolicy(initial=0.2, max_attempts=5))
    def create(message: Message, session: Any) -> None:
        calls.append(message.attempt)
        _effect(session, message, f"attempt {message.attempt}")
        if message.attempt < 3:
            raise RuntimeError("flaky downstream")

    billing.declare_topology()
    with orders.session() as session, session.begin():
        orders.outbox.send(session, "billing", "invoice.create", {"order": 7})
    worker = billing.worker()
    with running(orders.relay(), billing.receiver(), worker):
        wait_until(lambda: worker.processed == 1, what="processed after retries")
    assert calls == [1, 2, 3]
    # Only the successful attempt's effect was committed.
    assert rows(billing.settings.db_url or "", "SELECT info FROM effects") == [("attempt 3",)]
    status = rows(
        billing.settings.db_url or "",
        "SELECT status, attempts, finished, last_error FROM outbox_inbox.inbox_messages",
    )
    assert status == [("processed", 3, 3, None)]
    orders.close()
    billing.close()


def test_reject_is_dead_at_once_and_max_attempts_is_dead_with_the_error(
    db_url_factory: Any, mq_url: str
) -> None:
    orders, billing = _flow(db_url_factory, mq_url)

    @billing.on_command("invoice.create")
    def create(message: Message, session: Any) -> None:
        _effect(session, message)
        raise Reject("order does not exist")

    @billing.on_command("invoice.void", retry=RetryPolicy(initial=0.05, max_attempts=2))
    def void(message: Message, session: Any) -> None:
        _effect(session, message)
        raise ValueError("cannot void")

    billing.declare_topology()
    with orders.session() as session, session.begin():
        orders.outbox.send(session, "billing", "invoice.create", {})
        orders.outbox.send(session, "billing", "invoice.void", {})
        orders.outbox.send(session, "billing", "invoice.unknown", {})
    with running(orders.relay(), billing.receiver(), billing.worker()):
        wait_until(
            lambda: (
                scalar(
                    billing.settings.db_url or "",
                    "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'dead'",
                )
                == 3
            ),
            what="3 dead rows",
        )
    dead = dict(
        (r[0], r[1:])
        for r in rows(
            billing.settings.db_url or "",
            "SELECT routing_key, dead_reason, attempts, last_error"
            " FROM outbox_inbox.inbox_messages",
        )
    )
    assert dead["billing.invoice.create"][:2] == ("rejected", 1)
    assert dead["billing.invoice.void"][:2] == ("max_attempts", 2)
    assert "ValueError: cannot void" in dead["billing.invoice.void"][2]
    assert "Traceback" in dead["billing.invoice.void"][2]
    assert dead["billing.invoice.unknown"][0] == "no_handler"
    assert scalar(billing.settings.db_url or "", "SELECT count(*) FROM effects") == 0
    orders.close()
    billing.close()


def test_what_a_handler_sends_carries_causation_and_correlation(
    db_url_factory: Any, mq_url: str
) -> None:
    orders, billing = _flow(db_url_factory, mq_url)

    @billing.on_event("orders.order.placed")
    def placed(message: Message, session: Any) -> None:
        billing.outbox.publish(session, "invoice.created", {"order": message.payload["id"]})

    billing.declare_topology()
    with orders.session() as session, session.begin():
        event_id = orders.outbox.publish(
            session, "order.placed", {"id": 7}, correlation_id="checkout-42"
        )
    worker = billing.worker()
    with running(orders.relay(), billing.receiver(), worker):
        wait_until(lambda: worker.processed == 1)
    sent = rows(
        billing.settings.db_url or "",
        "SELECT routing_key, causation_id, correlation_id, payload"
        " FROM outbox_inbox.outbox_messages",
    )
    assert len(sent) == 1
    assert sent[0][:3] == ("billing.invoice.created", str(event_id), "checkout-42")
    assert sent[0][3] == {"order": 7}
    orders.close()
    billing.close()


def test_messages_of_one_key_are_handled_in_order_higher_priority_first_otherwise(
    db_url_factory: Any, mq_url: str
) -> None:
    orders, billing = _flow(db_url_factory, mq_url, worker_batch_size=10)
    seen: list[tuple[str | None, int]] = []

    @billing.on_command("job.run")
    def run(message: Message, session: Any) -> None:
        seen.append((message.key, message.payload["n"]))

    billing.declare_topology()
    with orders.session() as session, session.begin():
        for n in range(6):
            orders.outbox.send(session, "billing", "job.run", {"n": n}, key="a")
        orders.outbox.send(session, "billing", "job.run", {"n": 100}, priority=9)
        orders.outbox.send(session, "billing", "job.run", {"n": 101})
    receiver = billing.receiver()
    with running(orders.relay(), receiver):
        wait_until(lambda: receiver.stored == 8)
    worker = billing.worker()
    with running(worker):
        wait_until(lambda: worker.processed == 8)
    assert seen[0] == (None, 100)  # the priority 9 message first
    assert [n for k, n in seen if k == "a"] == list(range(6))
    orders.close()
    billing.close()


def test_service_start_runs_all_roles_and_stop_returns(db_url_factory: Any, mq_url: str) -> None:
    orders, billing = _flow(db_url_factory, mq_url)
    handled = threading.Event()

    @billing.on_event("orders.#")
    def any_order_event(message: Message, session: Any) -> None:
        _effect(session, message)
        handled.set()

    orders.start()
    billing.start()
    try:
        with orders.session() as session, session.begin():
            orders.outbox.publish(session, "order.placed", {"id": 1})
        assert handled.wait(15)
    finally:
        orders.stop()
        billing.stop()
    payloads = rows(
        billing.settings.db_url or "", "SELECT payload FROM outbox_inbox.inbox_messages"
    )
    assert [p[0] for p in payloads] == [{"id": 1}]
    assert json.dumps(payloads[0][0]) == '{"id": 1}'
    orders.close()
    billing.close()
