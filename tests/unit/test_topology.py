from __future__ import annotations

import pytest

from outbox_inbox.topology import service_topology, topic_matches


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("orders.order.*", "orders.order.placed", True),
        ("orders.order.*", "orders.order.placed.v2", False),
        ("orders.#", "orders", True),
        ("orders.#", "orders.order.placed", True),
        ("#", "anything.at.all", True),
        ("*.order.placed", "orders.order.placed", True),
        ("orders.*.placed", "orders.placed", False),
        ("orders.#.placed", "orders.placed", True),
        ("orders.#.placed", "orders.a.b.placed", True),
        ("billing.invoice.create", "billing.invoice.created", False),
    ],
)
def test_topic_matching_follows_amqp_rules(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


def test_service_topology_binds_own_commands_and_each_event_pattern() -> None:
    topology = service_topology("billing", ["orders.order.*", "orders.#", "orders.order.*"])
    bindings = {(b.exchange, b.queue, b.routing_key) for b in topology.bindings}
    assert ("commands", "billing.inbox", "billing.#") in bindings
    assert ("events", "billing.inbox", "orders.order.*") in bindings
    assert ("events", "billing.inbox", "orders.#") in bindings
    assert len([b for b in topology.bindings if b.exchange == "events"]) == 2
    commands = next(e for e in topology.exchanges if e.name == "commands")
    assert commands.type == "topic"
    assert commands.arguments["alternate-exchange"] == "unroutable"
    inbox = next(q for q in topology.queues if q.name == "billing.inbox")
    assert inbox.durable
    assert inbox.arguments["x-dead-letter-exchange"] == "dead_letter"
