"""The plugin's switch: with OUTBOX_INBOX_HARNESS_DB_URL and OUTBOX_INBOX_HARNESS_MQ_URL set,
the same user test runs on real PostgreSQL (a fresh database per harness, dropped after) and
RabbitMQ; without them, on SQLite and the in-memory broker."""

from __future__ import annotations

from typing import Any

import pika
import pytest

pytest_plugins = ["pytester"]

USER_TEST = """
from sqlalchemy import text

from outbox_inbox import Service


def build(*, db_url, broker):
    service = Service("billing", db_url=db_url, broker=broker)

    @service.on_command("invoice.create")
    def create(message, session):
        service.outbox.publish(session, "invoice.created", {"n": message.payload["n"]})

    return service


def test_a_command_is_handled_and_its_event_published(outbox_inbox_harness):
    billing = outbox_inbox_harness(build)
    billing.deliver("billing.invoice.create", {"n": 7})
    billing.run_until_idle()
    assert [m.payload for m in billing.published("billing.invoice.created")] == [{"n": 7}]
    with billing.service.engine.connect() as conn:
        dialect = conn.dialect.name
        database = conn.execute(text("SELECT 1")).scalar() and billing.service.engine.url.database
    print(f"RAN ON {dialect} {type(billing.broker).__name__} {database}")
"""


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    pytester.makepyfile(test_user=USER_TEST)
    return pytester.runpytest_subprocess("-q", "-s", "-p", "no:cacheprovider")


def test_without_the_switch_the_harness_runs_in_memory(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OUTBOX_INBOX_HARNESS_DB_URL", raising=False)
    monkeypatch.delenv("OUTBOX_INBOX_HARNESS_MQ_URL", raising=False)
    result = _run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*RAN ON sqlite MemoryBroker*"])


def test_with_the_switch_the_same_test_runs_on_postgresql_and_rabbitmq(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    postgres_server: Any,
    mq_url: str,
) -> None:
    monkeypatch.setenv("OUTBOX_INBOX_HARNESS_DB_URL", postgres_server.url("postgres"))
    monkeypatch.setenv("OUTBOX_INBOX_HARNESS_MQ_URL", mq_url)
    result = _run(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*RAN ON postgresql RabbitMQBroker oi_test_*"])
    with postgres_server.connect() as conn:  # the harness's database was dropped after
        left = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname LIKE 'oi_test_%'"
        ).fetchone()[0]
    assert left == 0
    # Nor anything on the broker: the harness deleted the queues it declared for billing.
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        for queue in ("billing.inbox", "billing.dead_letter", "billing.delay.1s"):
            channel = connection.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="NOT_FOUND"):
                channel.queue_declare(queue, passive=True)
    finally:
        connection.close()
