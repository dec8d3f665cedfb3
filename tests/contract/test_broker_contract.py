"""The shipped broker contract (outbox_inbox.testing.broker_contract), run on both brokers.

Every case runs on a fresh `MemoryBroker` and on `RabbitMQBroker` in a fresh vhost of a real
RabbitMQ 3.10 (tests/conftest.py). Where the two could differ, RabbitMQ is the reference: a
failure on RabbitMQ means the assertion is wrong, one on the memory broker that the broker is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.testing.broker_contract import BrokerContract


class TestMemoryBroker(BrokerContract):
    @pytest.fixture
    def broker(self) -> Iterator[MemoryBroker]:
        with MemoryBroker() as memory:
            yield memory


class TestRabbitMQ(BrokerContract):
    @pytest.fixture
    def broker(self, mq_url: str) -> Iterator[RabbitMQBroker]:
        yield RabbitMQBroker(mq_url)
