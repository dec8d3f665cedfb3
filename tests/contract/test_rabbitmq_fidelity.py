"""How RabbitMQ behaves where the library's topology never goes: kept as the project's own
record, outside the shipped broker contract (which asks only for what `service_topology`
declares), and run on RabbitMQ only, since the in-memory broker leaves these modes out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox_inbox.brokers import rabbitmq
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.errors import TopologyMismatch
from outbox_inbox.testing.broker_contract import (
    CONFIRMED,
    command,
    depth_becomes,
    numbers,
    publish,
    take,
    wire,
)
from outbox_inbox.topology import Queue, Topology, service_topology


@pytest.fixture
def broker(mq_url: str) -> RabbitMQBroker:
    return RabbitMQBroker(mq_url)


@pytest.fixture
def svc() -> str:
    return f"svc{uuid.uuid4().hex[:8]}"


@pytest.fixture
def opened() -> Iterator[Callable[[Any], Any]]:
    """Close what the case opened, after it."""
    things: list[Any] = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        thing.close()


def test_a_full_drop_head_queue_dead_letters_its_oldest_messages(
    broker: RabbitMQBroker, opened: Callable[[Any], Any], svc: str
) -> None:
    capped, overflow = f"{svc}.capped", f"{svc}.overflow"
    broker.declare(
        Topology(
            (),
            (
                Queue(
                    capped,
                    arguments={
                        "x-max-length": 2,
                        "x-dead-letter-exchange": "",
                        "x-dead-letter-routing-key": overflow,
                    },
                ),
                Queue(overflow),
            ),
            (),
        )
    )
    assert publish(broker, [wire("", capped, n=n) for n in range(4)]) == [CONFIRMED] * 4
    kept = take(opened(broker.consumer(capped, prefetch=10)), 2)
    assert numbers(kept) == [2, 3]
    dropped = take(opened(broker.consumer(overflow, prefetch=10)), 2)
    assert numbers(dropped) == [0, 1]
    assert [d.message.headers["x-death"][0]["reason"] for d in dropped] == ["maxlen"] * 2
    assert dropped[0].message.routing_key == overflow


def test_a_message_dead_lettered_back_into_the_queue_it_expired_in_is_dropped_as_a_cycle(
    broker: RabbitMQBroker, svc: str
) -> None:
    looping, onward, target = f"{svc}.looping", f"{svc}.onward", f"{svc}.target"

    def expiring_into(name: str, destination: str) -> Queue:
        return Queue(
            name,
            arguments={
                "x-message-ttl": 50,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": destination,
            },
        )

    broker.declare(
        Topology(
            (),
            (expiring_into(looping, looping), expiring_into(onward, target), Queue(target)),
            (),
        )
    )
    publish(broker, [wire("", looping), wire("", onward)])
    depth_becomes(broker, target, 1)  # dead-lettering works...
    depth_becomes(broker, looping, 0)  # ...but not round a cycle with no consumer in it
    time.sleep(0.2)
    assert broker.queue_depth(looping) == 0


def test_a_zero_ttl_message_reaches_a_waiting_consumer_or_is_dead_lettered_at_once(
    broker: RabbitMQBroker, opened: Callable[[Any], Any], svc: str
) -> None:
    now_or_never, missed = f"{svc}.now", f"{svc}.missed"
    ttl_zero = {
        "x-message-ttl": 0,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": missed,
    }
    broker.declare(Topology((), (Queue(now_or_never, arguments=ttl_zero), Queue(missed)), ()))
    consumer = opened(broker.consumer(now_or_never, prefetch=1))
    assert consumer.fetch(1, 0.1) == []  # consuming, with room for one
    publish(broker, [wire("", now_or_never, n=0), wire("", now_or_never, n=1)], window=1)
    assert numbers(take(consumer, 1)) == [0]
    assert numbers(take(opened(broker.consumer(missed, prefetch=10)), 1)) == [1]
    assert broker.queue_depth(now_or_never) == 0


def test_invalid_queue_arguments_are_refused_as_a_topology_mismatch(
    broker: RabbitMQBroker, svc: str
) -> None:
    queue = f"{svc}.q"
    for arguments in (
        {"x-message-ttl": -1},
        {"x-message-ttl": "5"},
        {"x-message-ttl": True},
        {"x-overflow": "drop-tail"},
        {"x-max-priority": 256},
        {"x-single-active-consumer": "true"},
        {"x-dead-letter-routing-key": "no-exchange"},
        {"x-queue-type": "lazy"},
        {"x-queue-type": "quorum", "x-max-priority": 5},
    ):
        with pytest.raises(TopologyMismatch):
            broker.declare(Topology((), (Queue(queue, arguments=arguments),), ()))
    with pytest.raises(TopologyMismatch):  # a quorum queue must be durable
        broker.declare(Topology((), (Queue(queue, False, {"x-queue-type": "quorum"}),), ()))
    assert broker.queue_depth(queue) is None


def test_a_confirm_ends_the_publishers_wait_at_once(
    broker: RabbitMQBroker,
    opened: Callable[[Any], Any],
    svc: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker.declare(service_topology(svc, []))
    # Each pump waiting its whole time for a confirm would take a minute per batch.
    monkeypatch.setattr(rabbitmq, "_CONFIRM_WAIT", 60.0)
    publisher = opened(broker.publisher())
    started = time.monotonic()
    for n in range(3):
        assert publisher.publish_batch([command(svc, n)], window=10, timeout=90) == [CONFIRMED]
    assert time.monotonic() - started < 30
