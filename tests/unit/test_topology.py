from __future__ import annotations

from dataclasses import replace

import pytest

from outbox_inbox.broker import DIFFERS, MISSING, PRESENT
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.errors import TopologyMismatch
from outbox_inbox.topology import Topology, service_topology, topic_matches
from outbox_inbox.topology_check import UNVERIFIED, Plan, apply_topology, check_topology


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


def _states(plan: Plan, *, bindings: bool) -> set[str]:
    return {i.state for i in plan.items if (i.kind == "binding") is bindings}


def test_topology_check_and_apply_work_on_the_memory_broker_through_its_operator() -> None:
    topology = service_topology("billing", ["orders.#"])
    broker = MemoryBroker()
    with broker.operator() as operator:
        before = check_topology(topology, operator, None)
        assert _states(before, bindings=False) == {MISSING}
        assert _states(before, bindings=True) == {MISSING}  # their ends are missing
        _, after = apply_topology(topology, broker, operator, None)
    assert after.complete and after.management_problem == "no management URL"
    assert _states(after, bindings=False) == {PRESENT}
    assert _states(after, bindings=True) == {UNVERIFIED}  # no management API in memory


def test_topology_apply_on_the_memory_broker_refuses_a_queue_declared_otherwise() -> None:
    topology = service_topology("billing", [])
    inbox = next(q for q in topology.queues if q.name == "billing.inbox")
    broker = MemoryBroker()
    broker.declare(Topology((), (replace(inbox, arguments={}),), ()))
    with broker.operator() as operator:
        plan = check_topology(topology, operator, None)
        assert [i.name for i in plan.having(DIFFERS)] == ["billing.inbox"]
        with pytest.raises(TopologyMismatch):
            apply_topology(topology, broker, operator, None)
        assert check_topology(topology, operator, None).having(MISSING) == plan.having(MISSING)
