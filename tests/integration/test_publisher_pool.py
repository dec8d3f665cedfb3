"""The relay publishes on a pool of connections of its own: bounded, shared by relay threads,
never a consumer's.

Each test counts (rows, messages, connections, channels); none measures time.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import cast
from urllib.parse import unquote, urlsplit

import pytest

from helpers import drain, make_service, publish_raw, running, scalar, wait_until
from outbox_inbox import BrokerError, Listener, Service
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.messages import OutgoingMessage
from outbox_inbox.testing.injection import memory_alarm
from outbox_inbox.topology import Binding, Exchange, Queue, Topology
from servers import RabbitMQServer

UNPUBLISHED = "SELECT count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"


def _declare_probe(mq_url: str, queue: str = "probe") -> None:
    RabbitMQBroker(mq_url).declare(
        Topology(
            exchanges=(Exchange("events", "topic"),),
            queues=(Queue(queue),),
            bindings=(Binding("events", queue, "#"),),
        )
    )


def _publish(svc: Service, count: int) -> None:
    with svc.session() as session, session.begin():
        for n in range(count):
            svc.outbox.publish(session, "order.placed", {"n": n})


def test_an_exhausted_pool_fails_the_checkout_after_its_timeout_and_the_rows_go_later(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    svc = make_service(
        "orders", db_url, mq_url, publisher_connections=1, publisher_checkout_timeout=0.3
    )
    broker = cast(RabbitMQBroker, svc.broker)
    svc.declare_topology()
    _declare_probe(mq_url)
    _publish(svc, 3)
    held = svc.broker.publisher()  # the pool's one connection, lent elsewhere
    relay = svc.relay()
    with caplog.at_level(logging.WARNING), pytest.raises(BrokerError, match="pool exhausted"):
        relay.relay_once()
    assert broker.publishers.exhausted == 1
    assert "all 1 publishing connections" in caplog.text
    password = urlsplit(mq_url).password
    assert password and password not in caplog.text
    # Nothing was lost nor counted against the rows: the claim rolled back.
    assert scalar(db_url, UNPUBLISHED) == 3
    assert scalar(db_url, "SELECT max(attempts) FROM outbox_inbox.outbox_messages") == 0
    held.close()  # given back: the relay's next attempt gets it
    assert relay.relay_once() == 3
    assert scalar(db_url, UNPUBLISHED) == 0
    assert len(drain(mq_url, "probe")) == 3
    assert broker.publishers.opened == 1  # the same connection, kept open by the pool
    svc.close()


class _ByThread(Listener):
    """Which thread committed which messages."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: dict[str, list[str]] = {}

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        with self.lock:
            mine = self.ids.setdefault(threading.current_thread().name, [])
            mine.extend(str(m.id) for m in messages)


def _confirm_channels(server: RabbitMQServer, vhost: str) -> list[str]:
    """The connections of the confirm-mode channels of `vhost`, one entry per channel."""
    out = server.rabbitmqctl(
        "list_channels", "-q", "--no-table-headers", "vhost", "confirm", "connection"
    )
    found = []
    for line in out.splitlines():
        if line.strip():
            name, confirm, connection = line.split("\t")
            if name == vhost and confirm == "true":
                found.append(connection)
    return found


def test_two_relay_threads_publish_a_backlog_each_once_over_two_pooled_channels(
    db_url: str, mq_url: str, local_rabbitmq_server: RabbitMQServer
) -> None:
    total = 3000
    listener = _ByThread()
    svc = make_service(
        "orders",
        db_url,
        mq_url,
        relay_threads=2,
        relay_batch_size=25,
        publish_window=25,
        listener=listener,
    )
    svc.declare_topology()
    _declare_probe(mq_url)
    _publish(svc, total)
    svc.start(receiver=False, workers=0)
    try:
        wait_until(lambda: scalar(db_url, UNPUBLISHED) == 0, timeout=60, what="the backlog")
        vhost = unquote(urlsplit(mq_url).path[1:])
        channels = _confirm_channels(local_rabbitmq_server, vhost)
    finally:
        svc.close()
    # Both threads published, each message once.
    assert sorted(listener.ids) == ["outbox-inbox-orders-relay", "outbox-inbox-orders-relay-1"]
    assert all(listener.ids.values())
    committed = [i for ids in listener.ids.values() for i in ids]
    assert len(committed) == len(set(committed)) == total
    got = drain(mq_url, "probe")
    assert len(got) == len({p.message_id for p, _ in got}) == total
    # Over the pool: two confirm channels, on two connections.
    assert len(channels) == len(set(channels)) == 2
    assert cast(RabbitMQBroker, svc.broker).publishers.opened == 2


def test_under_a_memory_alarm_the_relay_waits_while_the_receiver_drains_its_queue(
    db_url: str, mq_url: str, local_rabbitmq_server: RabbitMQServer
) -> None:
    queued, held_back = 50, 20
    svc = make_service("billing", db_url, mq_url)
    broker = cast(RabbitMQBroker, svc.broker)
    svc.declare_topology()
    _declare_probe(mq_url)
    for n in range(queued):
        body = b'{"n": %d}' % n
        publish_raw(
            mq_url, "commands", "billing.invoice.create", body, message_id=str(uuid.uuid4())
        )
    _publish(svc, 1)
    svc.start(receiver=False, workers=0)  # the relay alone first
    try:
        wait_until(lambda: scalar(db_url, UNPUBLISHED) == 0, what="the first row")
        with memory_alarm(local_rabbitmq_server):
            _publish(svc, held_back)
            wait_until(lambda: broker.flow_control.blocked, what="the relay's connection blocked")
            receiver = svc.receiver()  # same service, same broker object, own connection
            with running(receiver):
                wait_until(lambda: receiver.stored == queued, what="the queue drained")
            # The relay was held back all along: nothing of the alarm's rows went out.
            assert scalar(db_url, UNPUBLISHED) == held_back
            stored = scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages")
            assert stored == queued
        wait_until(lambda: scalar(db_url, UNPUBLISHED) == 0, timeout=60, what="the rows after")
    finally:
        svc.close()
    got = drain(mq_url, "probe")
    assert len(got) == len({p.message_id for p, _ in got}) == 1 + held_back


def test_a_pooled_connection_the_broker_closed_is_replaced_at_checkout_before_any_claim(
    db_url: str, mq_url: str, local_rabbitmq_server: RabbitMQServer
) -> None:
    svc = make_service("orders", db_url, mq_url)
    broker = cast(RabbitMQBroker, svc.broker)
    svc.declare_topology()
    _declare_probe(mq_url)
    svc.broker.publisher().close()  # opened, and now idle in the pool
    vhost = unquote(urlsplit(mq_url).path[1:])
    local_rabbitmq_server.rabbitmqctl("close_all_connections", "-p", vhost, "test")
    wait_until(
        lambda: (
            not local_rabbitmq_server.rabbitmqctl(
                "list_connections", "-q", "--no-table-headers", "-p", vhost, "name"
            ).strip()
        ),
        what="the connections closed",
    )
    _publish(svc, 3)
    relay = svc.relay()
    assert relay.relay_once() == 3
    # Published at the first attempt, on a new connection: the dead one was never used.
    assert scalar(db_url, UNPUBLISHED) == 0
    assert scalar(db_url, "SELECT max(attempts) FROM outbox_inbox.outbox_messages") == 0
    assert broker.publishers.opened == 2
    assert len(drain(mq_url, "probe")) == 3
    svc.close()
