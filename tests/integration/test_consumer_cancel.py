"""A consumer RabbitMQ cancels (``basic.cancel``: its queue deleted, its node failed) is noticed:
the receiver says so in one warning naming the queue, declares the topology again and consumes;
and `status` (the dashboard's health too) calls an inbox queue that is missing, or that holds
messages with no consumer, unhealthy."""

from __future__ import annotations

import logging
import subprocess
import sys

import pika
import pytest

from helpers import make_service, publish_raw, wait_until


def _consumers(mq_url: str, queue: str) -> int | None:
    """The consumers of `queue`, None when it does not exist (a passive declare)."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.consumer_count)
    except pika.exceptions.ChannelClosedByBroker:
        return None
    finally:
        connection.close()


def _delete(mq_url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


def test_a_receiver_whose_queue_is_deleted_declares_it_again_and_consumes(
    db_url: str, mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service("billing", db_url, mq_url)
    handled: list[object] = []
    service.on_command("invoice.create")(lambda message, session: handled.append(message))
    caplog.set_level(logging.INFO, logger="outbox_inbox")
    service.start()
    try:
        wait_until(lambda: _consumers(mq_url, "billing.inbox") == 1, what="the receiver")
        _delete(mq_url, "billing.inbox")  # RabbitMQ cancels the receiver's consumer
        wait_until(lambda: _consumers(mq_url, "billing.inbox") == 1, what="a consumer again")
        with service.engine.begin() as conn:  # routed by the bindings declared again
            service.outbox.send(conn, "billing", "invoice.create", {"n": 1})
        wait_until(lambda: handled, what="the command handled, without a restart")
    finally:
        service.stop()
        service.close()
    warnings = [  # (pika's are this test's own passive declares of the missing queue)
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("outbox_inbox")
    ]
    assert len([w for w in warnings if "billing.inbox" in w]) == 1, warnings
    assert any("cancelled the consumer of queue 'billing.inbox'" in w for w in warnings), warnings


def _status(db_url: str, mq_url: str) -> subprocess.CompletedProcess[str]:
    args = ["status", "--service", "billing", "--db-url", db_url, "--mq-url", mq_url]
    return subprocess.run(
        [sys.executable, "-m", "outbox_inbox.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_calls_a_missing_or_unconsumed_inbox_queue_unhealthy(
    db_url: str, mq_url: str
) -> None:
    service = make_service("billing", db_url, mq_url)
    try:
        missing = _status(db_url, mq_url)
        assert missing.returncode == 4, missing
        assert "unhealthy: queue billing.inbox is missing" in missing.stderr, missing
        assert any("billing.inbox is missing" in p for p in service.health().problems)

        service.declare_topology()
        assert not service.health().problems  # empty, no consumer: nothing waits
        publish_raw(mq_url, "commands", "billing.invoice.create", b'{"n": 1}')
        waiting = _status(db_url, mq_url)
        assert waiting.returncode == 4, waiting
        assert "billing.inbox holds 1 message(s) and no consumer" in waiting.stderr, waiting

        service.start(relay=False, workers=0)  # a receiver consumes: healthy again
        wait_until(lambda: _consumers(mq_url, "billing.inbox") == 1, what="the receiver")
        wait_until(lambda: not service.health().problems, what="healthy")
    finally:
        service.stop()
        service.close()
