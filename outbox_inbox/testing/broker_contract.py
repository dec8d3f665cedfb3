"""The broker contract: what a `Broker` and its `Operator` must do for the library to keep its
guarantees, and nothing more than its topology declares, as a pytest suite shipped with it. Subclass
`BrokerContract` with a ``broker`` fixture (a fresh broker, or virtual host, per test) and list what
your broker cannot do in `unsupported` (docs/testing.md, "Testing a broker"). RabbitMQ is the
reference. Names carry a random service name: the suite runs on a shared server."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from ..broker import (
    DIFFERS,
    MISSING,
    PRESENT,
    Broker,
    Consumer,
    Delivery,
    Found,
    PublishOutcome,
    QueuedMessage,
)
from ..errors import BrokerConnectionError, BrokerError, TopologyMismatch
from ..messages import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    H_DEAD_QUEUE,
    H_DEAD_REASON,
    H_ORIGINAL_EXCHANGE,
    H_ORIGINAL_ROUTING_KEY,
    H_RECEIVE_ATTEMPT,
    H_RETRY_DELAY,
    WireMessage,
)
from ..topology import (
    DEAD_LETTER_EXCHANGE,
    RETRY_EXCHANGE,
    UNROUTABLE_QUEUE,
    Binding,
    Exchange,
    Queue,
    Topology,
    dead_letter_queue,
    delay_queue,
    inbox_queue,
    service_topology,
)
from .servers import wait_until

CONFIRMED = PublishOutcome.CONFIRMED
RETURNED = PublishOutcome.RETURNED
NACKED = PublishOutcome.NACKED
SKIPPED = PublishOutcome.SKIPPED

#: What a broker may lack, named after what the library's topology (`service_topology`)
#: declares; each case of the suite that needs one says so with `requires`.
CAPABILITIES = frozenset(
    {
        "alternate_exchange",  # commands no service routes are kept in `unroutable`
        "reject_publish",  # a full inbox (x-max-length, x-overflow reject-publish) nacks
        "delay_tiers",  # x-message-ttl tiers whose expired messages return through `retry`
        "dead_letter_routing",  # a queue lets a message go to its x-dead-letter-exchange and
        # -routing-key with x-death records (expired tiers, the quorum delivery limit)
        "delivery_limit",  # quorum queues with x-delivery-limit
        "priority",  # x-max-priority on the inbox
        "single_active_consumer",  # x-single-active-consumer on the inbox
    }
)

Case = TypeVar("Case", bound=Callable[..., Any])


def requires(*capabilities: str) -> Callable[[Case], Case]:
    """Mark a case as needing `capabilities`: skipped for a broker that lists one unsupported."""
    if unknown := set(capabilities) - CAPABILITIES:
        raise ValueError(f"unknown capabilities {sorted(unknown)}")

    def mark(case: Case) -> Case:
        case.required_capabilities = frozenset(capabilities)  # type: ignore[attr-defined]
        return case

    return mark


def wire(
    exchange: str,
    routing_key: str,
    *,
    n: int = 0,
    key: str | None = None,
    priority: int | None = None,
    headers: dict[str, Any] | None = None,
) -> WireMessage:
    return WireMessage(
        exchange=exchange,
        routing_key=routing_key,
        body=b'{"n": %d}' % n,
        message_id=str(uuid.uuid4()),
        type=routing_key,
        correlation_id="corr-1",
        timestamp=1_700_000_000,
        priority=priority,
        app_id="contract",
        headers={"n": n, **(headers or {})},
        key=key,
    )


def command(service: str, n: int = 0, **kwargs: Any) -> WireMessage:
    return wire(COMMANDS_EXCHANGE, f"{service}.job.run", n=n, **kwargs)


def publish(
    broker: Broker, messages: Sequence[WireMessage], *, window: int = 10
) -> list[PublishOutcome]:
    with contextlib.closing(broker.publisher()) as publisher:
        return publisher.publish_batch(messages, window=window, timeout=5)


def take(consumer: Consumer, count: int, timeout: float = 5.0) -> list[Delivery]:
    """Fetch until `count` deliveries arrived; fail after `timeout` seconds."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(got)} of {count} deliveries in {timeout}s")
        got.extend(consumer.fetch(count - len(got), 0.2))
    return got


def numbers(deliveries: Sequence[Delivery | QueuedMessage | None]) -> list[int]:
    return [d.message.headers["n"] if d else -1 for d in deliveries]


def kept(copy: WireMessage, original: WireMessage, *properties: str) -> None:
    for name in properties:
        assert getattr(copy, name) == getattr(original, name), name


def depth_becomes(broker: Broker, queue: str, expected: int) -> None:
    """RabbitMQ requeues a closed consumer's deliveries a moment after the close returns."""
    wait_until(lambda: broker.queue_depth(queue) == expected, timeout=5, what=f"{queue} depth")


class BrokerContract:
    """The cases every broker must pass. Subclass it with a ``broker`` fixture (module doc)."""

    #: Capabilities (of CAPABILITIES) this broker lacks: their cases are skipped.
    unsupported: frozenset[str] = frozenset()

    @pytest.fixture(autouse=True)
    def _capabilities(self, request: pytest.FixtureRequest) -> None:
        if unknown := set(self.unsupported) - CAPABILITIES:
            raise ValueError(f"unsupported names unknown capabilities {sorted(unknown)}")
        needed: frozenset[str] = getattr(request.function, "required_capabilities", frozenset())
        if lacking := sorted(needed & self.unsupported):
            pytest.skip(f"the broker does not support {', '.join(lacking)}")

    @pytest.fixture
    def broker(self) -> Iterator[Broker]:
        raise NotImplementedError("a BrokerContract subclass defines the `broker` fixture")

    @pytest.fixture
    def opened(self, broker: Broker) -> Iterator[Callable[[Any], Any]]:
        """Register a publisher or consumer to be closed after the case, before the broker."""
        with contextlib.ExitStack() as closed_after:
            yield lambda thing: closed_after.enter_context(contextlib.closing(thing))

    @pytest.fixture
    def svc(self) -> str:
        return f"svc{uuid.uuid4().hex[:8]}"

    def test_declaring_twice_changes_nothing_and_a_conflicting_redeclare_raises_topology_mismatch(
        self, broker: Broker, svc: str
    ) -> None:
        topology = service_topology(svc, ["orders.order.*"])
        broker.declare(topology)
        assert publish(broker, [command(svc)]) == [CONFIRMED]
        broker.declare(topology)
        assert broker.queue_depth(inbox_queue(svc)) == 1  # the redeclare kept the queue's message

        inbox = topology.queues[0]
        other = {**inbox.arguments, "x-dead-letter-routing-key": "other"}
        with pytest.raises(TopologyMismatch):  # an argument RabbitMQ compares differs
            broker.declare(Topology((), (Queue(inbox.name, arguments=other),), ()))
        with pytest.raises(TopologyMismatch):  # durability differs
            broker.declare(Topology((), (Queue(inbox.name, False, inbox.arguments),), ()))
        with pytest.raises(TopologyMismatch):  # another exchange type
            broker.declare(Topology((Exchange(COMMANDS_EXCHANGE, "direct"),), (), ()))
        with pytest.raises(TopologyMismatch):  # the alternate exchange is compared
            broker.declare(Topology((Exchange(COMMANDS_EXCHANGE, "topic"),), (), ()))
        # Arguments RabbitMQ does not compare may differ.
        broker.declare(
            Topology(
                (Exchange(EVENTS_EXCHANGE, "topic", arguments={"x-note": "ignored"}),),
                (Queue(inbox.name, arguments={**inbox.arguments, "x-note": "ignored"}),),
                (),
            )
        )
        with pytest.raises(BrokerError):
            broker.declare(Topology((), (), (Binding(f"{svc}.missing", inbox.name, "#"),)))
        assert broker.queue_depth(inbox_queue(svc)) == 1

    def test_topic_exchange_matches_star_as_one_word_and_hash_as_zero_or_more_words(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        exchange = f"{svc}.topic"
        patterns = {"star": "a.*", "hash": "a.#", "tail": "#.z", "exact": "a.b"}
        broker.declare(
            Topology(
                (Exchange(exchange, "topic"),),
                tuple(Queue(f"{svc}.{name}") for name in patterns),
                tuple(Binding(exchange, f"{svc}.{name}", p) for name, p in patterns.items()),
            )
        )
        keys = ["a", "a.b", "a.b.c", "b.z", "z", "b.c", "a.b.z"]
        outcomes = publish(broker, [wire(exchange, k, n=i) for i, k in enumerate(keys)])
        assert outcomes == [CONFIRMED] * 5 + [RETURNED, CONFIRMED]

        received: dict[str, list[str]] = {}
        for name in patterns:
            queue = f"{svc}.{name}"
            count = broker.queue_depth(queue)
            assert count is not None
            consumer = opened(broker.consumer(queue, prefetch=0))
            received[name] = [d.message.routing_key for d in take(consumer, count)]
        assert received == {
            "star": ["a.b"],
            "hash": ["a", "a.b", "a.b.c", "a.b.z"],
            "tail": ["b.z", "z", "a.b.z"],
            "exact": ["a.b"],
        }

    def test_default_exchange_routes_by_queue_name_and_direct_retry_exchange_by_service(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        outcomes = publish(
            broker,
            [
                wire("", inbox_queue(svc), n=0),
                wire("", f"{svc}.no-such-queue", n=1),
                wire(RETRY_EXCHANGE, svc, n=2),
                wire(RETRY_EXCHANGE, f"{svc}.other", n=3),
            ],
        )
        assert outcomes == [CONFIRMED, RETURNED, CONFIRMED, RETURNED]
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        got = take(consumer, 2)
        assert [(d.message.exchange, d.message.routing_key) for d in got] == [
            ("", inbox_queue(svc)),
            (RETRY_EXCHANGE, svc),
        ]

    @requires("alternate_exchange")
    def test_command_to_a_service_without_a_queue_is_kept_in_unroutable(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        lost = wire(COMMANDS_EXCHANGE, f"ghost{svc}.parcel.ship", n=7)
        assert publish(broker, [lost]) == [CONFIRMED]  # the alternate exchange took it

        consumer = opened(broker.consumer(UNROUTABLE_QUEUE, prefetch=100))
        lost_id = lost.message_id  # a shared server may hold others
        found = wait_until(
            lambda: [d for d in consumer.fetch(100, 0.2) if d.message.message_id == lost_id],
            timeout=5,
            what="the command in unroutable",
        )[0]
        kept(found.message, lost, "exchange", "routing_key", "body")

    @requires("reject_publish")
    def test_publish_batch_reports_confirmed_returned_nacked_and_skips_the_rest_of_a_failed_key(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, ["src.thing.*"], max_length=2))
        batch = [
            wire(EVENTS_EXCHANGE, "src.thing.happened", n=0),  # subscribed
            wire(EVENTS_EXCHANGE, "src.other.happened", n=1),  # nobody subscribes: returned
            command(svc, 2, key="k"),  # fills the inbox
            command(svc, 3, key="k"),  # the inbox is full: nacked
            command(svc, 4, key="k"),  # skipped: its key failed
            command(svc, 5, key="j"),  # another key: tried, nacked
            wire(EVENTS_EXCHANGE, "src.other.happened", n=6, key="k"),  # skipped, though routable
        ]
        expected = [CONFIRMED, RETURNED, CONFIRMED, NACKED, SKIPPED, NACKED, SKIPPED]
        assert publish(broker, batch) == expected
        assert broker.queue_depth(inbox_queue(svc)) == 2

    @requires("reject_publish")
    def test_inbox_max_length_counts_ready_messages_not_unacknowledged_ones(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, [], max_length=1))
        assert publish(broker, [command(svc, 0)]) == [CONFIRMED]
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=1))
        assert numbers(take(consumer, 1)) == [0]
        assert publish(broker, [command(svc, 1), command(svc, 2)], window=1) == [CONFIRMED, NACKED]
        assert broker.queue_depth(inbox_queue(svc)) == 1

    def test_publish_to_a_missing_exchange_breaks_the_publisher(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publisher = opened(broker.publisher())
        # window=1: the first message is confirmed before the bad one goes out. With a wider window
        # RabbitMQ may close the channel before it confirms messages that were sent before.
        outcomes = publisher.publish_batch(
            [command(svc, 0), wire(f"{svc}.nowhere", "x", n=1), command(svc, 2)],
            window=1,
            timeout=0.5,
        )
        assert outcomes[0] == CONFIRMED
        # RabbitMQ closes the channel: nothing after is confirmed (TIMEOUT, FAILED or SKIPPED).
        assert not {CONFIRMED, RETURNED}.intersection(outcomes[1:])
        assert publisher.broken
        assert broker.queue_depth(inbox_queue(svc)) == 1
        assert publish(broker, [command(svc, 3)]) == [CONFIRMED]  # a new publisher works

    def test_fetch_stops_at_the_prefetch_window_until_an_ack_and_tags_start_at_one(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        assert publish(broker, [command(svc, n) for n in range(5)]) == [CONFIRMED] * 5
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=2))
        first = take(consumer, 2)
        assert [d.tag for d in first] == [1, 2]
        assert numbers(first) == [0, 1]
        assert not any(d.redelivered for d in first)
        assert broker.queue_depth(inbox_queue(svc)) == 3  # unacknowledged deliveries are not ready
        assert consumer.fetch(10, 0.2) == []  # the window is full
        consumer.ack_through(2)
        second = take(consumer, 2)
        assert [d.tag for d in second] == [3, 4]
        assert numbers(second) == [2, 3]

    def test_fetch_returns_what_has_arrived_without_waiting_for_a_batch_to_fill(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        assert publish(broker, [command(svc, 0)]) == [CONFIRMED]
        # A batch window would hold this fetch for up to `wait` (a minute) waiting for 9 more.
        started = time.monotonic()
        assert numbers(consumer.fetch(10, 60.0)) == [0]
        assert time.monotonic() - started < 30

    def test_fetch_on_an_empty_queue_returns_nothing_after_wait(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        started = time.monotonic()
        assert consumer.fetch(5, 0.3) == []
        assert 0.25 <= time.monotonic() - started < 2.0

    def test_fetch_from_a_missing_queue_raises_broker_error(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        consumer = opened(broker.consumer(f"{svc}.missing", prefetch=10))
        with pytest.raises(BrokerError, match="does not exist"):
            consumer.fetch(1, 0.2)
        assert broker.queue_depth(f"{svc}.missing") is None

    def test_ack_through_acknowledges_every_delivery_up_to_the_tag(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publish(broker, [command(svc, n) for n in range(4)])
        consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        got = take(consumer, 4)
        consumer.ack_through(got[2].tag)
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 1)
        again = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 1)
        assert numbers(again) == [3]
        assert again[0].redelivered

    def test_ack_acknowledges_only_that_delivery(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publish(broker, [command(svc, n) for n in range(3)])
        consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        got = take(consumer, 3)
        consumer.ack(got[1].tag)
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 2)
        assert numbers(take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 2)) == [0, 2]

    def test_acking_an_unknown_tag_closes_the_channel_and_requeues_its_deliveries(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publish(broker, [command(svc, n) for n in range(2)])
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        take(consumer, 2)
        # RabbitMQ answers the ack by closing the channel, which the next call reports.
        with pytest.raises(BrokerConnectionError):
            consumer.ack(99)
            consumer.fetch(1, 0.5)
        depth_becomes(broker, inbox_queue(svc), 2)

    def test_close_without_ack_requeues_deliveries_at_the_front_in_order_flagged_redelivered(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publish(broker, [command(svc, n) for n in range(5)])
        consumer = broker.consumer(inbox_queue(svc), prefetch=3)
        assert numbers(take(consumer, 3)) == [0, 1, 2]
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 5)
        again = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 5)
        assert numbers(again) == [0, 1, 2, 3, 4]
        assert [d.redelivered for d in again] == [True, True, True, False, False]
        assert [d.tag for d in again] == [1, 2, 3, 4, 5]  # tags are per consumer

    def test_consumers_without_single_active_consumer_share_the_queue(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        work = f"{svc}.work"
        broker.declare(Topology((), (Queue(work),), ()))
        first = opened(broker.consumer(work, prefetch=1))
        second = opened(broker.consumer(work, prefetch=1))
        assert first.fetch(1, 0.1) == [] and second.fetch(1, 0.1) == []  # both consume now
        publish(broker, [wire("", work, n=n) for n in range(3)])
        a, b = take(first, 1), take(second, 1)
        assert sorted(numbers(a) + numbers(b)) == [0, 1]
        assert broker.queue_depth(work) == 1  # both windows are full

    @requires("single_active_consumer")
    def test_single_active_consumer_a_second_consumer_gets_nothing_until_the_first_closes(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))  # the inbox has x-single-active-consumer
        publish(broker, [command(svc, n) for n in range(3)])
        active = broker.consumer(inbox_queue(svc), prefetch=10)
        standby = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        got = take(active, 3)
        assert standby.fetch(10, 0.2) == []
        publish(broker, [command(svc, n) for n in range(3, 5)])
        got += take(active, 2)
        assert standby.fetch(10, 0.2) == []
        active.ack_through(got[1].tag)
        active.close()
        taken_over = take(standby, 3)
        assert numbers(taken_over) == [2, 3, 4]
        assert all(d.redelivered for d in taken_over)

    @requires("priority")
    def test_priority_queue_delivers_higher_priority_first(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, [], max_priority=5))
        priorities = [None, 1, 9, 3, 0, 5]  # 9 counts as the maximum, 5; None as 0
        publish(broker, [command(svc, n, priority=p) for n, p in enumerate(priorities)])
        got = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 6)
        assert numbers(got) == [2, 5, 3, 1, 0, 4]
        assert [d.message.priority for d in got] == [9, 5, 3, 1, None, 0]  # the property is kept

    def test_queue_depth_counts_ready_messages_and_is_none_for_a_missing_queue(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        assert broker.queue_depth(inbox_queue(svc)) == 0
        publish(broker, [command(svc, n) for n in range(3)])
        assert broker.queue_depth(inbox_queue(svc)) == 3
        assert broker.queue_depth(dead_letter_queue(svc)) == 0
        assert broker.queue_depth(f"{svc}.missing") is None

    def test_a_consumer_changing_its_delivery_changes_nothing_anyone_else_sees(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        fanout = f"{svc}.fanout"
        broker.declare(
            Topology(
                (Exchange(fanout, "fanout"),),
                (Queue(f"{svc}.one"), Queue(f"{svc}.two")),
                (Binding(fanout, f"{svc}.one", ""), Binding(fanout, f"{svc}.two", "")),
            )
        )
        message = wire(fanout, "", headers={"nested": {"list": [1]}})
        publish(broker, [message])
        message.headers["nested"]["list"].append("changed by the publisher")

        one = broker.consumer(f"{svc}.one", prefetch=10)
        mine = take(one, 1)[0]
        mine.message.headers["nested"]["list"].append("changed by a consumer")
        mine.message.headers["added"] = True  # type: ignore[index]
        one.close()

        other = take(opened(broker.consumer(f"{svc}.two", prefetch=10)), 1)[0]
        again = take(opened(broker.consumer(f"{svc}.one", prefetch=10)), 1)[0]
        for delivery in (other, again):
            assert delivery.message.headers == {"n": 0, "nested": {"list": [1]}}

    @requires("delay_tiers", "dead_letter_routing")
    def test_forward_to_a_delay_tier_returns_to_the_inbox_through_retry_after_the_ttl(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, [], delay_tiers=(0.3,)))
        tier = delay_queue(svc, 0.3)
        original = command(svc, 1, headers={"own": "kept"}, priority=2)
        publish(broker, [original])
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        delivery = take(consumer, 1)[0]

        started = time.monotonic()
        consumer.forward(delivery, "", tier, {H_RECEIVE_ATTEMPT: 1, H_RETRY_DELAY: 300})
        assert broker.queue_depth(tier) == 1  # nobody consumes the delay tier
        back = take(consumer, 1, timeout=3)
        elapsed = time.monotonic() - started
        assert 0.28 <= elapsed <= 0.5, f"came back after {elapsed:.3f}s, the TTL is 0.3s"

        message = back[0].message
        assert (message.exchange, message.routing_key) == (RETRY_EXCHANGE, svc)
        assert not back[0].redelivered
        assert back[0].tag == 2
        kept(message, original, "message_id", "body", "priority", "correlation_id", "app_id")
        assert message.type == f"{svc}.job.run"
        headers = message.headers
        assert headers["own"] == "kept"
        assert headers[H_RECEIVE_ATTEMPT] == 1
        assert headers[H_RETRY_DELAY] == 300
        assert headers[H_ORIGINAL_EXCHANGE] == COMMANDS_EXCHANGE
        assert headers[H_ORIGINAL_ROUTING_KEY] == f"{svc}.job.run"
        death = headers["x-death"][0]
        assert (death["reason"], death["queue"], death["count"]) == ("expired", tier, 1)
        assert death["exchange"] == "" and death["routing-keys"] == [tier]
        assert headers["x-first-death-queue"] == tier
        assert broker.queue_depth(tier) == 0

        # A second trip keeps the first origin and counts the death in the same x-death entry.
        consumer.forward(back[0], "", tier, {H_RECEIVE_ATTEMPT: 2})
        twice = take(consumer, 1, timeout=3)
        headers = twice[0].message.headers
        assert headers[H_RECEIVE_ATTEMPT] == 2
        assert headers[H_ORIGINAL_EXCHANGE] == COMMANDS_EXCHANGE
        assert headers[H_ORIGINAL_ROUTING_KEY] == f"{svc}.job.run"
        assert [d["count"] for d in headers["x-death"]] == [2]

    def test_forward_to_the_dead_letter_exchange_lands_in_the_services_dead_letter_queue(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        original = command(svc, 4)
        publish(broker, [original])
        consumer = opened(broker.consumer(inbox_queue(svc), prefetch=10))
        delivery = take(consumer, 1)[0]
        consumer.forward(
            delivery,
            DEAD_LETTER_EXCHANGE,
            svc,
            {H_DEAD_REASON: "invalid: not JSON", H_DEAD_QUEUE: inbox_queue(svc)},
        )
        dead = take(opened(broker.consumer(dead_letter_queue(svc), prefetch=10)), 1)[0].message
        assert (dead.exchange, dead.routing_key) == (DEAD_LETTER_EXCHANGE, svc)
        assert dead.message_id == original.message_id
        assert dead.headers[H_DEAD_REASON] == "invalid: not JSON"
        assert dead.headers[H_DEAD_QUEUE] == inbox_queue(svc)
        assert dead.headers[H_ORIGINAL_ROUTING_KEY] == f"{svc}.job.run"
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 0)  # forward acknowledged the delivery

    def test_forward_that_cannot_route_raises_broker_error_and_keeps_the_delivery(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        publish(broker, [command(svc, 0)])
        consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        delivery = take(consumer, 1)[0]
        with pytest.raises(BrokerError, match="no queue"):
            consumer.forward(delivery, "", f"{svc}.no-such-queue", {})
        with pytest.raises(BrokerConnectionError):  # RabbitMQ closes the channel: 404
            consumer.forward(delivery, f"{svc}.no-such-exchange", "x", {})
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 1)  # never acknowledged
        again = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 1)[0]
        assert again.redelivered and again.message.message_id == delivery.message.message_id

    @requires("reject_publish")
    def test_forward_refused_by_a_full_queue_raises_broker_error_and_keeps_the_delivery(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        full = f"{svc}.full"
        broker.declare(
            Topology(
                (),
                (Queue(full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}),),
                (),
            )
        )
        publish(broker, [command(svc, 0)])
        consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        delivery = take(consumer, 1)[0]
        with pytest.raises(BrokerError, match="refused"):
            consumer.forward(delivery, "", full, {})
        consumer.close()
        depth_becomes(broker, inbox_queue(svc), 1)  # never acknowledged
        assert broker.queue_depth(full) == 0
        again = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 1)[0]
        assert again.redelivered and again.message.message_id == delivery.message.message_id

    @requires("delivery_limit", "dead_letter_routing")
    def test_quorum_inbox_dead_letters_a_message_returned_more_often_than_its_delivery_limit(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, [], queue_type="quorum", delivery_limit=1))
        publish(broker, [command(svc, 0)])
        first_consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        first = take(first_consumer, 1)[0]
        first_consumer.close()
        assert not first.redelivered and "x-delivery-count" not in first.message.headers

        second_consumer = broker.consumer(inbox_queue(svc), prefetch=10)
        second = take(second_consumer, 1)[0]
        second_consumer.close()
        assert second.redelivered and second.message.headers["x-delivery-count"] == 1

        dead_consumer = broker.consumer(dead_letter_queue(svc), prefetch=10)
        try:
            dead = take(dead_consumer, 1)[0].message
        finally:
            dead_consumer.close()
        assert (dead.exchange, dead.routing_key) == (DEAD_LETTER_EXCHANGE, svc)
        death = dead.headers["x-death"][0]
        assert (death["reason"], death["queue"]) == ("delivery_limit", inbox_queue(svc))
        assert dead.headers["x-first-death-reason"] == "delivery_limit"
        assert broker.queue_depth(inbox_queue(svc)) == 0

    def test_operator_checks_find_declared_objects_present_and_others_missing_or_differing(
        self, broker: Broker, svc: str
    ) -> None:
        topology = service_topology(svc, ["src.thing.*"], delay_tiers=(5,))
        broker.declare(topology)
        assert publish(broker, [command(svc)]) == [CONFIRMED]
        with broker.operator() as operator:
            assert operator.flow_control(timeout=0.5) is None
            assert operator.description == broker.description
            assert {operator.check_exchange(e).state for e in topology.exchanges} == {PRESENT}
            assert {operator.check_queue(q).state for q in topology.queues} == {PRESENT}
            assert operator.check_queue(Queue(f"{svc}.missing")) == Found(MISSING)
            assert operator.check_exchange(Exchange(f"{svc}.missing", "topic")) == Found(MISSING)
            inbox = topology.queues[0]
            other = Queue(inbox.name, arguments={**inbox.arguments, "x-max-priority": 3})
            assert operator.check_queue(other).state == DIFFERS
            assert operator.check_queue(Queue(inbox.name, False, inbox.arguments)).state == DIFFERS
            commands = topology.exchanges[0]
            assert operator.check_exchange(Exchange(commands.name, "direct")).state == DIFFERS
            assert operator.check_exchange(Exchange(commands.name, "topic")).state == DIFFERS
            assert operator.check_queue(inbox).state == PRESENT  # checking changed nothing
        assert broker.queue_depth(inbox.name) == 1

    def test_operator_queue_info_counts_ready_messages_and_consumers_purge_and_delete_drop_them(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        inbox = inbox_queue(svc)
        publish(broker, [command(svc, n) for n in range(4)])
        consumer = broker.consumer(inbox, prefetch=1)
        with broker.operator() as operator:
            assert numbers(take(consumer, 1)) == [0]
            assert operator.queue_info(inbox) == (3, 1)
            assert operator.purge_queue(inbox) == 3  # the unacknowledged delivery stays
            assert operator.queue_info(inbox) == (0, 1)
            consumer.close()
            wait_until(lambda: operator.queue_info(inbox) == (1, 0), timeout=5, what="the requeue")
            assert operator.delete_queue(inbox) == 1
            assert operator.queue_info(inbox) is None
            assert operator.purge_queue(inbox) == 0
            assert operator.delete_queue(inbox) == 0
        assert broker.queue_depth(inbox) is None
        assert publish(broker, [wire(RETRY_EXCHANGE, svc)]) == [RETURNED]  # its bindings went too

    def test_a_reader_takes_without_ack_and_its_close_returns_the_rest_in_place_redelivered(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        letters = dead_letter_queue(svc)
        publish(broker, [wire(DEAD_LETTER_EXCHANGE, svc, n=n) for n in range(3)])
        with broker.operator() as operator:
            reader = operator.reader(letters)
            assert reader.queue == letters and reader.depth() == 3
            first, second = reader.get(), reader.get()
            assert first is not None and second is not None
            assert numbers([first, second]) == [0, 1] and not first.redelivered
            assert reader.depth() == 1  # taken messages are not ready
            reader.ack(first)
            reader.close()
            depth_becomes(broker, letters, 2)
            again = operator.reader(letters)
            back = [again.get(), again.get()]
            assert again.get() is None
            assert numbers(back) == [1, 2]
            assert [m.redelivered for m in back if m is not None] == [True, False]
        depth_becomes(broker, letters, 2)
        with broker.operator() as operator, pytest.raises(BrokerError):
            operator.reader(f"{svc}.missing").get()

    def test_a_reader_republishes_a_copy_with_its_properties_and_new_headers_then_acks(
        self, broker: Broker, opened: Callable[[Any], Any], svc: str
    ) -> None:
        broker.declare(service_topology(svc, []))
        letters = dead_letter_queue(svc)
        original = wire(DEAD_LETTER_EXCHANGE, svc, n=5, priority=4, headers={"dropped": True})
        publish(broker, [original])
        with broker.operator() as operator:
            reader = operator.reader(letters)
            taken = reader.get()
            assert taken is not None
            assert not reader.republish(taken, RETRY_EXCHANGE, f"{svc}.nobody", {"n": 5})
            assert reader.republish(taken, RETRY_EXCHANGE, svc, {"n": 5, "replayed": 1})
            reader.ack(taken)
            with pytest.raises(BrokerError):
                reader.republish(taken, f"{svc}.no-such-exchange", svc, {})
        depth_becomes(broker, letters, 0)
        copy = take(opened(broker.consumer(inbox_queue(svc), prefetch=10)), 1)[0].message
        assert (copy.exchange, copy.routing_key) == (RETRY_EXCHANGE, svc)
        assert copy.headers == {"n": 5, "replayed": 1}
        kept(copy, original, "message_id", "body", "type", "correlation_id", "timestamp")
        kept(copy, original, "priority", "app_id", "content_type")

    def test_tail_copies_what_the_exchange_routes_by_pattern_until_told_to_stop(
        self, broker: Broker, svc: str
    ) -> None:
        broker.declare(service_topology(svc, ["src.thing.*"]))
        seen: list[str] = []
        queues: list[str] = []

        def ready(queue: str) -> None:
            queues.append(queue)
            keys = ["src.thing.made", "src.other.made", "src.thing.sold", "src.thing.kept"]
            publish(broker, [wire(EVENTS_EXCHANGE, k) for k in keys])

        def copied(message: WireMessage) -> bool:
            seen.append(message.routing_key)
            return len(seen) < 2

        with broker.operator() as operator:
            operator.tail(
                EVENTS_EXCHANGE,
                ["src.thing.*", "nothing.#"],
                on_ready=ready,
                on_message=copied,
                should_stop=lambda: False,
            )
            assert seen == ["src.thing.made", "src.thing.sold"]  # until on_message said no
            started = time.monotonic()
            operator.tail(
                EVENTS_EXCHANGE,
                ["src.#"],
                on_ready=queues.append,
                on_message=copied,
                should_stop=lambda: time.monotonic() - started > 0.3,
            )
            assert 0.3 < time.monotonic() - started < 2
            assert seen == ["src.thing.made", "src.thing.sold"]
        assert broker.queue_depth(inbox_queue(svc)) == 3  # the inbox got its own copies
        with broker.operator() as operator:  # the session's end deleted its tail queues
            wait_until(
                lambda: all(operator.queue_info(q) is None for q in queues),
                timeout=5,
                what=f"{queues} deleted",
            )


__all__ = ["BrokerContract"]
