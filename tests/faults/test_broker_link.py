"""A dead link to RabbitMQ is noticed by the heartbeat, and a refused login is not waited for."""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pytest

from helpers import make_service, wait_until
from outbox_inbox import BrokerAccessRefused, Message
from outbox_inbox.brokers.amqp_connection import close_quietly
from outbox_inbox.testing.injection import blackhole
from servers import RabbitMQServer

pytestmark = pytest.mark.faults


def test_a_blackholed_link_is_noticed_by_the_heartbeat_and_the_receiver_reconnects(
    db_url: str,
    mq_url: str,
    local_rabbitmq_server: RabbitMQServer,
    iptables: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Without heartbeats nothing would notice within the blackhole (the server's default is
    # 60 s, and the receiver only reads). pika checks every heartbeat + 5 s whether anything
    # arrived, so with heartbeat=1 the dead link is found within 6-12 s.
    billing = make_service("billing", db_url, mq_url, heartbeat=1)
    handled: list[int] = []

    @billing.on_command("invoice.create")
    def create(message: Message, session: object) -> None:
        handled.append(message.payload["n"])

    billing.declare_topology()
    receiver = billing.receiver()
    stop = threading.Event()
    thread = threading.Thread(target=receiver.run, args=(stop,), daemon=True)
    with caplog.at_level(logging.INFO, logger="outbox_inbox.receiver"):
        thread.start()
        try:
            time.sleep(1)  # the receiver is connected and idle
            with blackhole(iptables, local_rabbitmq_server.port):
                wait_until(
                    lambda: any("retrying every" in r.getMessage() for r in caplog.records),
                    timeout=16,
                    what="the receiver to notice the dead link while it lasts",
                )
            wait_until(
                lambda: any("working again after" in r.getMessage() for r in caplog.records),
                timeout=15,
                what="the receiver to reconnect once the link is back",
            )
            with billing.session() as session, session.begin():
                billing.outbox.send(session, "billing", "invoice.create", {"n": 1})
            billing.relay().relay_once()
            wait_until(lambda: receiver.stored == 1, timeout=15, what="the message stored")
        finally:
            stop.set()
            thread.join(15)
            billing.close()


def test_a_refused_broker_login_fails_start_at_once_instead_of_waiting(
    db_url: str, mq_url: str
) -> None:
    parts = urlsplit(mq_url)
    user = parts.username or "guest"
    wrong = parts._replace(netloc=f"{user}:not-the-password@{parts.hostname}:{parts.port}")
    service = make_service("billing", db_url, urlunsplit(wrong))
    started = time.monotonic()
    with pytest.raises(BrokerAccessRefused) as refused:
        service.start()  # fail_fast is off: only an unreachable broker is waited for
    assert time.monotonic() - started < 10
    assert "not-the-password" not in str(refused.value)
    service.close()


def test_closing_a_connection_to_a_dead_link_returns_within_its_bound(
    mq_url: str, local_rabbitmq_server: RabbitMQServer, iptables: str
) -> None:
    from outbox_inbox.brokers.rabbitmq import RabbitMQBroker

    connection = RabbitMQBroker(mq_url).connect()
    with blackhole(iptables, local_rabbitmq_server.port):
        started = time.monotonic()
        close_quietly(connection, timeout=1.0)
        took = time.monotonic() - started
    assert took < 3, f"closing took {took:.1f} s"
