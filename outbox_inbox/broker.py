"""The broker interface. `brokers.rabbitmq` implements it on RabbitMQ (pika), `brokers.memory`
in this process's memory.

Two ports: `Broker` is what the relay, receiver and worker use (declare, publish, consume);
`Operator` is what an operator uses, through `Broker.operator` (check what is declared, queue
depths, read, ack and requeue a dead-letter queue, tail an exchange).

Thread safety: a `Publisher`, `Consumer` or `Operator` belongs to the thread that opened it;
open one per thread. `Broker` objects may be shared; RabbitMQ's keeps a pool of publishing
connections (closed by `Broker.close`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from .messages import WireMessage
from .topology import Exchange, Queue, Topology


class PublishOutcome(enum.Enum):
    """What became of one message handed to `Publisher.publish_batch`."""

    CONFIRMED = "confirmed"  # the broker took responsibility for it
    RETURNED = "returned"  # confirmed, but no queue was bound for its routing key
    NACKED = "nacked"  # the broker refused it (e.g. a full queue with reject-publish)
    TIMEOUT = "timeout"  # no confirm in time: unknown, so it will be sent again
    SKIPPED = "skipped"  # not sent: an earlier message with its ordering key failed
    FAILED = "failed"  # not confirmed because the connection failed
    # The broker closed the channel while this message was unconfirmed, for a reason of its
    # own (`Publisher.refusal`): this message or another one in flight with it was refused.
    # Published alone, a REFUSED message is the one refused.
    REFUSED = "refused"


@dataclass(frozen=True)
class Refusal:
    """The broker's reason for closing a publishing channel: its reply code and text, and
    `max_body`, its largest accepted body when the refusal names it (``max_message_size``)."""

    code: int
    text: str
    max_body: int | None = None

    @property
    def message_specific(self) -> bool:
        """True when the message itself was refused (406 PRECONDITION_FAILED: its size or a
        property), not its destination (404: no such exchange; 403: no permission to it)."""
        return self.code == 406

    def __str__(self) -> str:
        return f"refused by the broker: {self.code} {self.text}"

    @classmethod
    def of(cls, code: int, text: str) -> Refusal:
        """The refusal a broker's reply code and text describe (RabbitMQ's wording)."""
        found = _MAX_SIZE.search(text)
        return cls(code, text, int(found.group(1)) if found else None)


#: How RabbitMQ names its limit when it refuses a message for its size.
_MAX_SIZE = re.compile(r"larger than configured max size (\d+)")


@dataclass(frozen=True)
class Delivery:
    """A message taken from a queue and not yet acknowledged."""

    message: WireMessage
    tag: int
    redelivered: bool


class Publisher(Protocol):
    def publish_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> list[PublishOutcome]:
        """Publish persistent, mandatory messages with confirms; one outcome per message. At most
        `window` messages are unconfirmed at a time. Two messages with the same ordering key are
        never in flight together, and once one fails, the later ones with that key are SKIPPED, so a
        key's messages reach the queue in the order given. Per-message problems are outcomes; if the
        connection fails, the unconfirmed messages are FAILED and `broken` becomes true. If the
        broker closes the channel over a message (too large, a missing exchange), the unconfirmed
        messages are REFUSED, the unsent ones SKIPPED, `refusal` says why and `broken` becomes true.
        """

    @property
    def refusal(self) -> Refusal | None:
        """Why the broker last closed this publisher's channel; None if it never did."""

    @property
    def broken(self) -> bool:
        """True once the connection failed: close this publisher and open another."""

    def idle(self) -> None:
        """Service the connection while there is nothing to publish (heartbeats, closes): call
        it at least every few seconds while idle. It never raises and never blocks for long; a
        connection found dead makes `broken` true."""

    def close(self) -> None:
        """Give the publisher up: its connection closes, or returns to the broker's pool."""


class Consumer(Protocol):
    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to `max_count` deliveries: waits at most `wait` seconds for a first one, then
        returns at once with it and whatever else has already arrived — never waits for a batch
        to fill, so a lone message is stored without delay and batches grow with the load. An
        empty list when none arrived within `wait`. Raises BrokerConnectionError when the
        connection is lost; unacknowledged deliveries then return to the queue."""

    def ack_through(self, tag: int) -> None:
        """Acknowledge every delivery up to and including `tag`."""

    def ack(self, tag: int) -> None: ...

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        """Republish `delivery` to `exchange` with `headers` added, confirmed, then ack it (delay
        tiers, dead letters), its original exchange and routing key kept in
        ``x-original-exchange`` and ``x-original-routing-key``. BrokerError if the target does
        not route or refuses, BrokerConnectionError if the connection fails: not acked then."""

    def close(self) -> None: ...


class Broker(Protocol):
    """A message broker: declares topology, opens publishers and consumers."""

    def declare(self, topology: Topology) -> None:
        """Declare every exchange, queue and binding; raise TopologyMismatch on a conflict."""

    def publisher(self) -> Publisher: ...

    def consumer(self, queue: str, *, prefetch: int) -> Consumer: ...

    def queue_depth(self, queue: str) -> int | None:
        """Messages ready in `queue` (not the unacknowledged ones), or None if it is missing."""

    def body_limit(self, size: int) -> int | None:
        """The broker's largest accepted message body if it refuses a body of `size` bytes, else
        None. Raises BrokerError when the broker cannot be asked."""

    def operator(self) -> Operator:
        """A new operator session on this broker; close it (or use ``with``). Raises
        BrokerConnectionError when the broker cannot be reached."""

    def close(self) -> None:
        """Release what the broker object holds (RabbitMQ: the publisher pool's connections)."""

    @property
    def description(self) -> str:
        """Where the broker is, with any password masked."""


#: What a check found: the object exists as declared, does not exist, or exists otherwise.
PRESENT, MISSING, DIFFERS = "present", "missing", "differs"


@dataclass(frozen=True)
class Found:
    """The outcome of checking one exchange or queue."""

    state: str
    detail: str = ""


@dataclass(frozen=True)
class QueuedMessage:
    """A message taken from a queue by a `QueueReader` and not acknowledged (yet). `properties`
    is what the broker's adapter keeps for a faithful republish; callers pass it back untouched."""

    tag: int
    message: WireMessage
    redelivered: bool
    properties: Any = None


class QueueReader(Protocol):
    """Takes messages from one queue without acknowledging them, then acks or republishes. A
    message taken and never acknowledged goes back to the queue, at its place, flagged
    redelivered, when the reader closes. A message is acked only after its copy was confirmed."""

    @property
    def queue(self) -> str: ...

    def depth(self) -> int:
        """Messages ready in the queue now (not counting those this reader holds)."""

    def get(self) -> QueuedMessage | None:
        """The next ready message, unacknowledged; None when the queue has no more."""

    def ack(self, message: QueuedMessage) -> None:
        """Remove `message` from the queue for good."""

    def republish(
        self, message: QueuedMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> bool:
        """Publish a copy of `message` (its body and properties, these `headers`), mandatory
        and confirmed. False when the broker returned it as unroutable; raises BrokerError when
        the broker refused it. The original is not acknowledged here."""

    def close(self) -> None:
        """Every message taken and not acknowledged returns to the queue."""


class Operator(Protocol):
    """One operator session on a broker (`Broker.operator`): checks, queue depths, dead-letter
    queues read and moved, tails. Used from one thread; close it, or use it with ``with``
    (inherited by an implementation that subclasses it). Raises BrokerConnectionError when the
    broker is lost, BrokerError when it refuses."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def description(self) -> str:
        """Where the broker is, with any password masked."""

    def flow_control(self, timeout: float = 1.0) -> str | None:
        """The broker's reason if it blocks publishers now (a memory or disk alarm), else None."""

    def check_exchange(self, exchange: Exchange) -> Found:
        """Whether `exchange` exists with the declared type, durability and arguments."""

    def check_queue(self, queue: Queue) -> Found:
        """Whether `queue` exists with the declared durability and arguments."""

    def queue_info(self, name: str) -> tuple[int, int] | None:
        """(ready messages, consumers) of queue `name`, or None if it does not exist."""

    def purge_queue(self, name: str) -> int:
        """Drop every ready message of queue `name`; return how many (0 if it is missing)."""

    def delete_queue(self, name: str) -> int:
        """Delete queue `name` and its messages; return how many it held (0 if missing)."""

    def reader(self, queue: str) -> QueueReader:
        """A reader of `queue`. Raises BrokerError if it is missing."""

    def tail(
        self,
        exchange: str,
        patterns: list[str],
        *,
        on_ready: Callable[[str], None],
        on_message: Callable[[WireMessage], bool],
        should_stop: Callable[[], bool],
    ) -> None:
        """Copy messages routed by `exchange` with any of `patterns` to `on_message`, through a
        private queue the broker deletes when the session ends (`on_ready(queue)` once bound),
        until `should_stop()` is true (checked at least every 0.2 s) or `on_message` is False."""

    def close(self) -> None:
        """End the session; messages read and not acknowledged return to their queues."""


__all__ = [
    "Broker", "Consumer", "Delivery", "Found", "Operator", "PublishOutcome", "Publisher",
    "QueueReader", "QueuedMessage", "Refusal",
]  # fmt: skip
