"""What only the in-memory broker has: its lifecycle, its timer thread, and many threads at once.

Its RabbitMQ-like behaviour is proved by test_broker_contract.py, on both brokers.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from outbox_inbox.broker import Delivery, PublishOutcome
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.errors import BrokerConnectionError, BrokerError
from outbox_inbox.messages import COMMANDS_EXCHANGE, WireMessage
from outbox_inbox.topology import (
    Exchange,
    Queue,
    Topology,
    delay_queue,
    inbox_queue,
    service_topology,
)

SERVICE = "billing"


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    with MemoryBroker() as memory:
        yield memory


def command(n: int, key: str | None = None) -> WireMessage:
    return WireMessage(
        exchange=COMMANDS_EXCHANGE,
        routing_key=f"{SERVICE}.job.run",
        body=b"{}",
        message_id=str(uuid.uuid4()),
        headers={"n": n, "key": key},
        key=key,
    )


def timer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("memory-broker-ttl-")]


def test_each_broker_describes_itself_as_a_memory_url_of_its_own() -> None:
    with MemoryBroker() as one, MemoryBroker() as two, MemoryBroker(name="demo") as named:
        assert one.description.startswith("memory://")
        assert one.description != two.description
        assert named.description == "memory://demo"


def test_delay_tiers_expire_on_time_with_no_one_reading_them(broker: MemoryBroker) -> None:
    tiers = (0.1, 0.25, 0.4)
    broker.declare(service_topology(SERVICE, [], delay_tiers=tiers))
    publisher = broker.publisher()
    started = time.monotonic()
    # Longest first: each tier is a queue of its own, so a long delay never holds a short one.
    outcomes = publisher.publish_batch(
        [
            WireMessage(
                exchange="",
                routing_key=delay_queue(SERVICE, tier),
                body=b"{}",
                message_id=str(tier),
            )
            for tier in reversed(tiers)
        ],
        window=10,
        timeout=1,
    )
    assert outcomes == [PublishOutcome.CONFIRMED] * 3
    consumer = broker.consumer(inbox_queue(SERVICE), prefetch=10)
    arrivals: dict[str, float] = {}
    while len(arrivals) < 3 and time.monotonic() - started < 3:
        for delivery in consumer.fetch(1, 1.0):  # returns as soon as one arrives
            arrivals[delivery.message.message_id] = time.monotonic() - started
            consumer.ack(delivery.tag)
    consumer.close()
    for tier in tiers:
        assert arrivals[str(tier)] == pytest.approx(tier, abs=0.05)


def test_close_stops_the_timer_thread_and_everything_fails_afterwards() -> None:
    broker = MemoryBroker()
    broker.declare(service_topology(SERVICE, [], delay_tiers=(1,)))
    publisher = broker.publisher()
    publisher.publish_batch(
        [WireMessage(exchange="", routing_key=delay_queue(SERVICE, 1), body=b"{}", message_id="d")],
        window=1,
        timeout=1,
    )
    name = "memory-broker-ttl-" + broker.description.removeprefix("memory://")
    assert [t.name for t in timer_threads() if t.name == name] == [name]
    consumer = broker.consumer(inbox_queue(SERVICE), prefetch=10)
    consumer.fetch(1, 0.01)
    blocked: list[BaseException] = []

    def wait_for_a_message() -> None:
        try:
            consumer.fetch(1, 10.0)
        except BrokerConnectionError as exc:
            blocked.append(exc)

    waiter = threading.Thread(target=wait_for_a_message)
    waiter.start()
    time.sleep(0.05)
    broker.close()
    waiter.join(timeout=2)
    assert not waiter.is_alive() and len(blocked) == 1  # the waiting fetch failed at once
    assert not [t for t in timer_threads() if t.name == name]
    broker.close()  # idempotent

    assert publisher.broken
    assert publisher.publish_batch([command(1)], window=1, timeout=1) == [PublishOutcome.FAILED]
    for call in (
        lambda: broker.declare(service_topology(SERVICE, [])),
        lambda: broker.publisher(),
        lambda: broker.consumer(inbox_queue(SERVICE), prefetch=1),
        lambda: broker.queue_depth(inbox_queue(SERVICE)),
        lambda: consumer.fetch(1, 0.01),
    ):
        with pytest.raises(BrokerConnectionError):
            call()
    consumer.close()  # never raises


def test_publishers_in_many_threads_lose_nothing_and_keep_each_keys_order(
    broker: MemoryBroker,
) -> None:
    broker.declare(service_topology(SERVICE, [], single_active_consumer=False))
    threads, per_thread = 8, 250
    failures: list[list[PublishOutcome]] = []

    def produce(key: str) -> None:
        publisher = broker.publisher()
        for start in range(0, per_thread, 50):
            outcomes = publisher.publish_batch(
                [command(n, key) for n in range(start, start + 50)], window=10, timeout=1
            )
            if set(outcomes) != {PublishOutcome.CONFIRMED}:
                failures.append(outcomes)
        publisher.close()

    received: list[Delivery] = []
    consumer = broker.consumer(inbox_queue(SERVICE), prefetch=100)
    producers = [threading.Thread(target=produce, args=(f"k{i}",)) for i in range(threads)]
    for producer in producers:
        producer.start()
    deadline = time.monotonic() + 10
    while len(received) < threads * per_thread and time.monotonic() < deadline:
        batch = consumer.fetch(100, 0.05)
        if batch:
            received.extend(batch)
            consumer.ack_through(batch[-1].tag)
    for producer in producers:
        producer.join()
    consumer.close()

    assert failures == []
    assert len(received) == threads * per_thread
    assert [d.tag for d in received] == list(range(1, threads * per_thread + 1))
    by_key: dict[str, list[int]] = {}
    for delivery in received:
        by_key.setdefault(delivery.message.headers["key"], []).append(delivery.message.headers["n"])
    assert by_key == {f"k{i}": list(range(per_thread)) for i in range(threads)}
    assert broker.queue_depth(inbox_queue(SERVICE)) == 0


def test_modes_the_topology_never_declares_are_refused_and_unknown_arguments_ignored(
    broker: MemoryBroker,
) -> None:
    for topology in (
        Topology((Exchange("matcher", "headers"),), (), ()),
        Topology((), (Queue("capped", arguments={"x-max-length": 2}),), ()),  # drop-head
        Topology((), (Queue("capped", arguments={"x-max-length": 2, "x-overflow": "x"}),), ()),
        Topology((), (Queue("log", arguments={"x-queue-type": "stream"}),), ()),
    ):
        with pytest.raises(BrokerError):
            broker.declare(topology)
    assert broker.queue_depth("capped") is None and broker.queue_depth("log") is None
    broker.declare(Topology((), (Queue("q", arguments={"x-expires": 1000}),), ()))
    assert broker.queue_depth("q") == 0
