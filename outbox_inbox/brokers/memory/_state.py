"""The memory broker's objects: exchanges, queues and their messages, and the rules that read
a queue's arguments and judge a redeclare, as RabbitMQ 3.10 does for what the topology declares."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from threading import Condition
from typing import Any, Protocol

from ...broker import Refusal
from ...errors import BrokerError
from ...messages import WireMessage
from ...topology import Exchange, Queue, topic_matches

EXCHANGE_TYPES = frozenset({"direct", "fanout", "topic"})

#: The queue arguments RabbitMQ 3.10 compares on a redeclare, among those the topology declares
#: (a quorum queue compares ``x-delivery-limit`` too); any other argument may differ.
COMPARED_ARGUMENTS = (
    "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-max-length",
    "x-max-priority", "x-overflow", "x-single-active-consumer", "x-queue-type",
)  # fmt: skip

#: Header a quorum queue adds to a message it delivers again (RabbitMQ 3.10).
H_DELIVERY_COUNT = "x-delivery-count"


class Refused(Exception):
    """The broker refuses a publish as RabbitMQ does, by closing the channel."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


class Subscriber(Protocol):
    """A consumer as a queue sees it (`MemoryConsumer`); called with the broker's lock held."""

    queue: str
    arrived: Condition  # notified on a delivery, and when the queue or broker goes away

    def has_capacity(self) -> bool: ...

    def push(self, entry: Entry) -> None: ...


@dataclass(frozen=True)
class QueueSettings:
    """What a queue's arguments mean."""

    kind: str = "classic"
    ttl: float | None = None  # seconds
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    max_length: int | None = None  # with reject-publish overflow
    max_priority: int | None = None
    single_active_consumer: bool = False
    delivery_limit: int | None = None

    @classmethod
    def of(cls, queue: Queue) -> QueueSettings:
        """The settings `queue` declares. Raises BrokerError for a mode left out here."""
        args = queue.arguments
        kind = args.get("x-queue-type", "classic")
        if kind not in ("classic", "quorum"):
            raise BrokerError(f"queue {queue.name!r}: {kind} queues are not kept in memory")
        max_length = args.get("x-max-length")
        if max_length is not None and args.get("x-overflow") != "reject-publish":
            raise BrokerError(
                f"queue {queue.name!r}: in memory, x-max-length needs x-overflow reject-publish"
            )
        ttl = args.get("x-message-ttl")
        return cls(
            kind=kind,
            ttl=ttl / 1000 if ttl is not None else None,
            dead_letter_exchange=args.get("x-dead-letter-exchange"),
            dead_letter_routing_key=args.get("x-dead-letter-routing-key"),
            max_length=max_length,
            max_priority=args.get("x-max-priority"),
            single_active_consumer=args.get("x-single-active-consumer") is True,
            delivery_limit=args.get("x-delivery-limit") if kind == "quorum" else None,
        )


@dataclass(eq=False)
class Entry:
    """One message in one queue."""

    seq: int  # arrival order in the broker: a requeued message goes back to its place by it
    message: WireMessage  # as routed; the broker never changes it, deliveries get copies
    expires_at: float | None  # monotonic; kept when requeued, as RabbitMQ keeps it
    band: int = 0  # priority band
    redelivered: bool = False
    returns: int = 0  # times returned to a quorum queue: its x-delivery-count

    def delivered(self) -> WireMessage:
        """A consumer's own copy, with the x-delivery-count a quorum queue adds to a return."""
        headers = copy.deepcopy(dict(self.message.headers))
        if self.returns:
            headers[H_DELIVERY_COUNT] = self.returns
        return replace(self.message, headers=headers)


class ExchangeState:
    def __init__(self, spec: Exchange) -> None:
        self.spec = spec
        self.alternate: str | None = spec.arguments.get("alternate-exchange")
        self.bindings: dict[tuple[str, str], None] = {}  # (routing key, queue), ordered set

    def route(self, routing_key: str) -> list[str]:
        """The queues bound for `routing_key`, each once, in binding order."""
        kind = self.spec.type
        matched: dict[str, None] = {}
        for pattern, queue in self.bindings:
            if (
                kind == "fanout"
                or (kind == "direct" and pattern == routing_key)
                or (kind == "topic" and topic_matches(pattern, routing_key))
            ):
                matched[queue] = None
        return list(matched)

    def difference(self, spec: Exchange) -> str | None:
        """How `spec` differs from this exchange where RabbitMQ looks (type, durability and,
        among the arguments, only the alternate), or None."""
        for prop, before, now in (
            ("type", self.spec.type, spec.type),
            ("durable", self.spec.durable, spec.durable),
            ("alternate-exchange", self.alternate, spec.arguments.get("alternate-exchange")),
        ):
            if not _same(before, now):
                return (
                    f"exchange {spec.name!r} exists with other arguments: {prop} is {before!r}, "
                    f"declared now as {now!r}"
                )
        return None


class QueueState:
    def __init__(self, spec: Queue, settings: QueueSettings) -> None:
        self.spec, self.settings = spec, settings
        bands = (settings.max_priority or 0) + 1
        self.bands: list[deque[Entry]] = [deque() for _ in range(bands)]
        # A quorum queue serves returned messages first, in the order they came back.
        self.returned: deque[Entry] = deque()
        self.consumers: list[Subscriber] = []  # registration order
        self.next_consumer = 0  # round robin

    @property
    def name(self) -> str:
        return self.spec.name

    def ready(self) -> int:
        return len(self.returned) + sum(len(band) for band in self.bands)

    def deques(self) -> Iterator[deque[Entry]]:
        """Every deque of ready messages, in delivery order: returns, then priority high to low."""
        yield self.returned
        yield from reversed(self.bands)

    def band_of(self, priority: int | None) -> int:
        return min(priority or 0, self.settings.max_priority or 0)

    def pop(self) -> Entry | None:
        for ready in self.deques():
            if ready:
                return ready.popleft()
        return None

    def requeue(self, entries: list[Entry]) -> None:
        """Put entries back: a quorum queue serves them next, a classic one at their old place."""
        if self.settings.kind == "quorum":
            self.returned.extend(entries)
            return
        for band_number, band in enumerate(self.bands):
            back = [e for e in entries if e.band == band_number]
            if back:
                merged = sorted([*band, *back], key=lambda e: e.seq)
                band.clear()
                band.extend(merged)

    def active_consumer(self) -> Subscriber | None:
        """The consumer to give the next message to, or None if none can take one."""
        if not self.consumers:
            return None
        if self.settings.single_active_consumer:
            first = self.consumers[0]
            return first if first.has_capacity() else None
        count = len(self.consumers)
        for step in range(count):
            consumer = self.consumers[(self.next_consumer + step) % count]
            if consumer.has_capacity():
                self.next_consumer = (self.next_consumer + step + 1) % count
                return consumer
        return None

    def difference(self, spec: Queue) -> str | None:
        """How `spec` differs from this queue where RabbitMQ looks, or None."""
        what = f"queue {spec.name!r} exists with other arguments"
        if self.spec.durable != spec.durable:
            return f"{what}: durable is {self.spec.durable}, declared now as {spec.durable}"
        quorum = self.settings.kind == "quorum"
        for name in (*COMPARED_ARGUMENTS, "x-delivery-limit") if quorum else COMPARED_ARGUMENTS:
            before, now = self.spec.arguments.get(name), spec.arguments.get(name)
            if name == "x-queue-type":  # no type means classic
                before, now = before or "classic", now or "classic"
            if not _same(before, now):
                return f"{what}: {name} is {before!r}, declared now as {now!r}"
        return None


def _same(before: Any, now: Any) -> bool:
    """Equal as AMQP values: ``True`` and ``1`` differ, as they do to RabbitMQ."""
    return isinstance(before, bool) == isinstance(now, bool) and before == now


def private_copy(message: WireMessage) -> WireMessage:
    """The broker's own copy: nobody holding the original can change what consumers see. The
    ordering key is the publisher's business and does not travel, as on AMQP."""
    return replace(
        message, body=bytes(message.body), headers=copy.deepcopy(dict(message.headers)), key=None
    )


def with_death(
    headers: Mapping[str, Any], reason: str, queue: str, exchange: str, routing_key: str
) -> dict[str, Any]:
    """`headers` with the ``x-death`` record RabbitMQ 3.10 writes when it dead-letters: a
    death in the same queue for the same reason counts up its entry and moves it first;
    ``x-first-death-*`` are written with the first record only."""
    out = copy.deepcopy(dict(headers))
    deaths = out["x-death"] if isinstance(out.get("x-death"), list) else []
    this = (queue, reason)
    for index, death in enumerate(deaths):
        if isinstance(death, Mapping) and (death.get("queue"), death.get("reason")) == this:
            counted = {**death, "count": int(death.get("count", 0)) + 1}
            out["x-death"] = [counted, *deaths[:index], *deaths[index + 1 :]]
            return out
    if not deaths:
        out["x-first-death-reason"] = reason
        out["x-first-death-queue"] = queue
        out["x-first-death-exchange"] = exchange
    now = datetime.now(UTC).replace(microsecond=0)
    event = {"count": 1, "reason": reason, "queue": queue, "time": now, "exchange": exchange}
    out["x-death"] = [{**event, "routing-keys": [routing_key]}, *deaths]
    return out
