"""pika's lines about a failed connection attempt stay below the level the user chose.

The roles report an outage themselves (one warning); pika's own ERROR lines and tracebacks for
each failed attempt are relabelled DEBUG, and printed only where DEBUG is (``-vv``).
"""

from __future__ import annotations

import logging

import pytest

from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.errors import BrokerConnectionError
from outbox_inbox.testing.servers import free_port


def _attempt_refused_connection() -> None:
    broker = RabbitMQBroker(f"amqp://guest:guest@127.0.0.1:{free_port()}/", connect_timeout=2)
    with pytest.raises(BrokerConnectionError):
        broker.connect()


class _Collect(logging.Handler):
    """A handler with no level of its own, as ``logging.basicConfig`` installs."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _pika_records_at(level: int) -> list[logging.LogRecord]:
    """pika's records of a failed connection with the root logger at `level`, pika's own
    loggers left to inherit it (whatever another test set them to)."""
    root = logging.getLogger()
    handler, old_level = _Collect(), root.level
    pika_loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name == "pika" or name.startswith("pika.")
    ]
    old_levels = [logger.level for logger in pika_loggers]
    for logger in pika_loggers:
        logger.setLevel(logging.NOTSET)
    root.addHandler(handler)
    root.setLevel(level)
    try:
        _attempt_refused_connection()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for logger, old in zip(pika_loggers, old_levels, strict=True):
            logger.setLevel(old)
    return [r for r in handler.records if r.name.startswith("pika")]


def test_pika_says_nothing_at_info_when_a_connection_attempt_fails() -> None:
    assert _pika_records_at(logging.INFO) == []


def test_pika_connection_failures_are_debug_lines_where_debug_is_on() -> None:
    records = _pika_records_at(logging.DEBUG)
    # pika did log its failure (what the filter exists for), relabelled DEBUG.
    assert any(r.exc_info or "refused" in r.getMessage().lower() for r in records), records
    assert {r.levelname for r in records} == {"DEBUG"}
