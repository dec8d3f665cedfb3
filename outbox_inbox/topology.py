"""The broker objects a service needs: exchanges, queues and bindings (DESIGN.md §4)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .messages import COMMANDS_EXCHANGE, EVENTS_EXCHANGE

DEAD_LETTER_EXCHANGE = "dead_letter"
RETRY_EXCHANGE = "retry"
UNROUTABLE_EXCHANGE = "unroutable"
UNROUTABLE_QUEUE = "unroutable"


@dataclass(frozen=True)
class Exchange:
    name: str
    type: str
    durable: bool = True
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    name: str
    durable: bool = True
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Binding:
    exchange: str
    queue: str
    routing_key: str


@dataclass(frozen=True)
class Topology:
    """What one service declares. Declaring it twice changes nothing."""

    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]


def inbox_queue(service: str) -> str:
    """Name of the queue a service consumes from."""
    return f"{service}.inbox"


def dead_letter_queue(service: str) -> str:
    """Name of the queue holding what a service's receiver could never store."""
    return f"{service}.dead_letter"


def tier_name(seconds: float) -> str:
    """A readable name of a delay tier: ``1s``, ``30s``, ``5m``, ``2h``, ``1.5s``."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def delay_queue(service: str, seconds: float) -> str:
    """Name of the service's delay queue whose messages wait `seconds`."""
    return f"{service}.delay.{tier_name(seconds)}"


def command_routing_key(service: str, command: str) -> str:
    """Routing key of `command` (``entity.verb``) addressed to `service`."""
    return f"{service}.{command}"


def service_topology(
    service: str,
    event_patterns: Iterable[str],
    *,
    single_active_consumer: bool = True,
    delay_tiers: Iterable[float] = (),
    queue_type: str = "classic",
    delivery_limit: int | None = None,
    max_length: int | None = None,
    max_priority: int | None = None,
) -> Topology:
    """Build the topology of `service`, subscribed to `event_patterns` on the events exchange:
    the objects of docs/topology.md. The shared exchanges are declared by every service with
    the same arguments, so the order in which services start does not matter; with
    `queue_type="quorum"` the services sharing a broker must agree on it (`unroutable`)."""
    quorum = queue_type == "quorum"
    inbox_args: dict[str, Any] = {
        # A message the receiver rejects (or that a quorum queue gives up on) is kept.
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        "x-dead-letter-routing-key": service,
    }
    if single_active_consumer:
        # Receipt order is per-key handling order: one receiver consumes at a time, the others
        # stand by and take over when it goes away.
        inbox_args["x-single-active-consumer"] = True
    if quorum:
        inbox_args["x-queue-type"] = "quorum"
        if delivery_limit is not None:
            inbox_args["x-delivery-limit"] = delivery_limit
    if max_length is not None:
        # A full queue refuses new messages; the relay sees a nack and keeps the row.
        inbox_args["x-max-length"] = max_length
        inbox_args["x-overflow"] = "reject-publish"
    if max_priority is not None:
        inbox_args["x-max-priority"] = max_priority
    exchanges = (
        Exchange(COMMANDS_EXCHANGE, "topic", arguments={"alternate-exchange": UNROUTABLE_EXCHANGE}),
        Exchange(EVENTS_EXCHANGE, "topic"),
        Exchange(DEAD_LETTER_EXCHANGE, "topic"),
        Exchange(UNROUTABLE_EXCHANGE, "fanout"),
        Exchange(RETRY_EXCHANGE, "direct"),
    )
    # In a cluster every queue of the service is a quorum queue, replicated on a majority of
    # the nodes: the dead letters and the delayed retries survive a node as the inbox does.
    kept: dict[str, Any] = {"x-queue-type": "quorum"} if quorum else {}
    queues = [
        Queue(inbox_queue(service), arguments=inbox_args),
        Queue(dead_letter_queue(service), arguments=dict(kept)),
        Queue(UNROUTABLE_QUEUE, arguments=dict(kept)),
    ]
    # A delayed message leaves its tier by expiring (back to the inbox through `retry`): on a
    # quorum queue at-least-once dead-lettering keeps it until the inbox has it (it needs
    # reject-publish overflow).
    at_least_once = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
    for seconds in delay_tiers:
        tier = {
            "x-message-ttl": int(seconds * 1000),
            "x-dead-letter-exchange": RETRY_EXCHANGE,
            "x-dead-letter-routing-key": service,
            **(kept | at_least_once if quorum else {}),
        }
        queues.append(Queue(delay_queue(service, seconds), arguments=tier))
    bindings = (
        Binding(COMMANDS_EXCHANGE, inbox_queue(service), f"{service}.#"),
        Binding(RETRY_EXCHANGE, inbox_queue(service), service),
        Binding(DEAD_LETTER_EXCHANGE, dead_letter_queue(service), service),
        Binding(UNROUTABLE_EXCHANGE, UNROUTABLE_QUEUE, ""),
        *(Binding(EVENTS_EXCHANGE, inbox_queue(service), p) for p in sorted(set(event_patterns))),
    )
    return Topology(exchanges, tuple(queues), bindings)


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more words."""
    return _match(pattern.split("."), routing_key.split("."))


def _match(pattern: list[str], words: list[str]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _match(rest, words[1:])
