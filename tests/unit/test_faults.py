"""Fault messages without servers: their routing key, and which handlers take them."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_inbox import ConfigurationError, Message, Service
from outbox_inbox.faults import fault_routing_key, is_fault
from outbox_inbox.handlers import Subscription
from outbox_inbox.messages import COMMAND
from outbox_inbox.outbox import _check_name
from outbox_inbox.topology import service_topology, topic_matches


def test_a_fault_routing_key_is_a_valid_name_the_senders_inbox_binding_takes() -> None:
    key = fault_routing_key("orders", "billing.invoice.create")
    assert key == "orders.fault.billing.invoice.create"
    assert _check_name(key, "routing key") == key
    assert is_fault(key)
    bound = [
        b.routing_key
        for b in service_topology("orders", []).bindings
        if (b.exchange, b.queue) == ("commands", "orders.inbox")
    ]
    assert any(topic_matches(pattern, key) for pattern in bound), bound


def test_on_fault_takes_the_faults_its_pattern_matches_and_nothing_else() -> None:
    orders = Service("orders", db_url="sqlite:///:memory:")

    def exact(message: Message, session: Any) -> None: ...
    def every(message: Message, session: Any) -> None: ...
    def command(message: Message, session: Any) -> None: ...

    orders.on_fault("billing.invoice.create")(exact)
    orders.on_fault("billing.#")(every)
    orders.on_command("invoice.create")(command)

    def find(kind: str, key: str) -> list[Subscription]:
        return orders.handlers.find(kind, key).every

    assert [s.handler for s in find(COMMAND, "orders.fault.billing.invoice.create")] == [
        exact,
        every,
    ]
    assert [s.handler for s in find(COMMAND, "orders.fault.billing.invoice.void")] == [every]
    assert [s.handler for s in find(COMMAND, "orders.invoice.create")] == [command]
    # A fault no on_fault handler matches still has one: it is logged and processed, not dead.
    (fallback,) = find(COMMAND, "orders.fault.shipping.parcel.ship")
    assert fallback.handler not in (exact, every, command)


def test_a_command_named_like_a_fault_is_refused() -> None:
    orders = Service("orders", db_url="sqlite:///:memory:")
    with pytest.raises(ConfigurationError, match="on_fault"):
        orders.on_command("fault.billing.invoice.create")
