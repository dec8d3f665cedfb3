"""Compare the topology a service needs with what the broker holds (`outbox-inbox topology`).
Exchanges and queues are checked through the management API when it answers, else through the
broker's `Operator`; bindings cannot be listed over AMQP 0-9-1, so without the API they stay
``unverified`` unless their exchange or queue is missing (docs/cli.md, "How it checks")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .broker import DIFFERS, MISSING, PRESENT, Broker, Found, Operator
from .errors import TopologyMismatch
from .management import ManagementAPI, ManagementUnavailable
from .topology import UNROUTABLE_QUEUE, Binding, Exchange, Queue, Topology

#: Further states of a checked object (besides present, missing, differs).
UNVERIFIED = "unverified"  # a binding, when the management API does not answer
EXTRA = "extra"  # a binding on one of the service's queues that the service does not declare


@dataclass(frozen=True)
class Item:
    """One exchange, queue or binding and what the broker holds of it."""

    kind: str  # exchange | queue | binding
    name: str
    state: str
    detail: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "state": self.state, "detail": self.detail}


@dataclass(frozen=True)
class Plan:
    """Every object the service needs, in declaration order, then the extra bindings."""

    items: tuple[Item, ...]
    #: Why the management API was not used (None when it was).
    management_problem: str | None

    def having(self, *states: str) -> list[Item]:
        return [item for item in self.items if item.state in states]

    @property
    def complete(self) -> bool:
        """True when nothing is missing or declared otherwise (unverified bindings aside)."""
        return not self.having(MISSING, DIFFERS)

    def as_dict(self) -> dict[str, Any]:
        return {
            "items": [item.as_dict() for item in self.items],
            "counts": dict(Counter(item.state for item in self.items)),
            "management_api": self.management_problem or "used",
        }


def binding_name(binding: Binding) -> str:
    return f"{binding.exchange} -> {binding.queue} ({binding.routing_key or 'no key'})"


def check_topology(topology: Topology, admin: Operator, api: ManagementAPI | None) -> Plan:
    """Check every object of `topology` against the broker of `admin`; read-only. Raises
    BrokerError when the broker cannot be reached."""
    problem = "no management URL" if api is None else None
    try:
        if api is not None:
            api.check()
    except ManagementUnavailable as exc:
        problem, api = str(exc), None
    items: list[Item] = []
    for exchange in topology.exchanges:
        found = (
            _by_api(exchange, api.exchange(exchange.name))
            if api
            else admin.check_exchange(exchange)
        )
        items.append(Item("exchange", exchange.name, found.state, found.detail))
    for queue in topology.queues:
        found = _by_api(queue, api.queue(queue.name)) if api else admin.check_queue(queue)
        items.append(Item("queue", queue.name, found.state, found.detail))
    missing = {(item.kind, item.name) for item in items if item.state == MISSING}
    actual = _bindings_by_api(topology, api) if api is not None else {}
    for binding in topology.bindings:
        if {("exchange", binding.exchange), ("queue", binding.queue)} & missing:
            state, detail = MISSING, "its exchange or queue is missing"
        elif api is None:
            state, detail = UNVERIFIED, "management API unreachable"
        else:
            bound = (binding.exchange, binding.routing_key) in actual[binding.queue]
            state, detail = PRESENT if bound else MISSING, ""
        items.append(Item("binding", binding_name(binding), state, detail))
    items.extend(_extra_bindings(topology, actual))
    return Plan(tuple(items), problem)


def _bindings_by_api(topology: Topology, api: ManagementAPI) -> dict[str, set[tuple[str, str]]]:
    """The (exchange, routing key) bindings the broker holds on each of the service's queues."""
    return {
        queue_name: {
            (str(b["source"]), str(b.get("routing_key", "")))
            for b in api.queue_bindings(queue_name)
            if b.get("destination_type", "queue") == "queue"
        }
        for queue_name in dict.fromkeys(b.queue for b in topology.bindings)
    }


def _extra_bindings(topology: Topology, actual: Mapping[str, set[tuple[str, str]]]) -> list[Item]:
    """The bindings on the service's queues that the service does not declare."""
    # A binding the service no longer declares still routes messages to it (which then die
    # with no_handler). `apply` does not remove it: unbinding is left to the operator.
    expected = {(b.queue, b.exchange, b.routing_key) for b in topology.bindings}
    why = "not declared by the service"
    return [
        Item("binding", binding_name(Binding(source, queue, key)), EXTRA, why)
        for queue, present in actual.items()
        if queue != UNROUTABLE_QUEUE  # shared by every service
        for source, key in sorted(present)
        if (queue, source, key) not in expected
    ]


def apply_topology(
    topology: Topology, broker: Broker, admin: Operator, api: ManagementAPI | None
) -> tuple[Plan, Plan]:
    """Declare what is missing; return the plans before and after. Raises TopologyMismatch,
    declaring nothing, when an exchange or queue exists with other arguments."""
    before = check_topology(topology, admin, api)
    differs = [i for i in before.having(DIFFERS) if i.kind != "binding"]
    if differs:
        names = ", ".join(f"{i.kind} {i.name}" for i in differs)
        raise TopologyMismatch(
            f"{names} exist(s) with other arguments; nothing was declared. RabbitMQ cannot "
            "change them in place: drain and delete them, then apply again"
        )
    broker.declare(topology)
    return before, check_topology(topology, admin, api)


def _argument_differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    out = []
    for name in sorted(set(expected) | set(actual)):
        want, have = expected.get(name), actual.get(name)
        if want != have or type(want) is not type(have):
            out.append(f"{name}: expected {_show(want)}, broker has {_show(have)}")
    return out


def _show(value: Any) -> str:
    return "none" if value is None else repr(value)


def _by_api(declared: Exchange | Queue, found: Mapping[str, Any] | None) -> Found:
    """`declared` against `found`, what the management API shows of it (None: absent)."""
    if found is None:
        return Found(MISSING)
    problems = []
    if isinstance(declared, Exchange) and found.get("type") != declared.type:
        problems.append(f"type: expected {declared.type}, broker has {found.get('type')}")
    if bool(found.get("durable")) != declared.durable:
        problems.append(f"durable: expected {declared.durable}, broker has {found.get('durable')}")
    actual = dict(found.get("arguments") or {})
    # Newer brokers show the default queue type explicitly; it is what "none given" means.
    if actual.get("x-queue-type") == "classic" and "x-queue-type" not in declared.arguments:
        del actual["x-queue-type"]
    problems += _argument_differences(declared.arguments, actual)
    return Found(DIFFERS, "; ".join(problems)) if problems else Found(PRESENT)


__all__ = ["Item", "Plan", "apply_topology", "check_topology"]
