"""The broker interface. `brokers.rabbitmq` implements it on RabbitMQ (pika).

Thread safety: a `Publisher` or `Consumer` belongs to the thread that opened it; open one per
thread. `Broker` objects themselves only hold settings and may be shared.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .messages import WireMessage
from .topology import Topology


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
    """The broker's reason for closing a publishing channel: its reply code and text.

    `max_body` is the broker's largest accepted message body when the refusal names it
    (RabbitMQ's ``max_message_size``), else None.
    """

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
        """Publish persistent, mandatory messages with confirms; one outcome per message.

        At most `window` messages are unconfirmed at a time. Two messages with the same
        ordering key are never in flight together, and once one fails, the later ones with that
        key are SKIPPED, so a key's messages reach the queue in the order given. Per-message
        problems are outcomes; if the connection fails, the unconfirmed messages are FAILED and
        `broken` becomes true. If the broker closes the channel over a message (too large, a
        missing exchange), the unconfirmed messages are REFUSED, the unsent ones SKIPPED,
        `refusal` says why and `broken` becomes true.
        """
        ...

    @property
    def refusal(self) -> Refusal | None:
        """Why the broker last closed this publisher's channel; None if it never did."""
        ...

    @property
    def broken(self) -> bool:
        """True once the connection failed: close this publisher and open another."""
        ...

    def idle(self) -> None:
        """Service the connection while there is nothing to publish (heartbeats, closes).

        Call it at least every few seconds while idle; it never raises and never blocks for
        long. A connection found dead makes `broken` true.
        """
        ...

    def close(self) -> None: ...


class Consumer(Protocol):
    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to `max_count` deliveries, waiting at most `wait` seconds once one has arrived.

        Returns an empty list when none arrived within `wait`. Raises BrokerConnectionError
        when the connection is lost; unacknowledged deliveries then return to the queue.
        """
        ...

    def ack_through(self, tag: int) -> None:
        """Acknowledge every delivery up to and including `tag`."""
        ...

    def ack(self, tag: int) -> None: ...

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        """Republish `delivery` to `exchange` with `headers` added, confirmed, then ack it.

        The original exchange and routing key are kept in ``x-original-exchange`` and
        ``x-original-routing-key``. Used for delay tiers and dead letters. Raises BrokerError
        if the target does not route or refuses, BrokerConnectionError if the connection fails;
        the delivery is then not acknowledged.
        """
        ...

    def close(self) -> None: ...


class Broker(Protocol):
    """A message broker: declares topology, opens publishers and consumers."""

    def declare(self, topology: Topology) -> None:
        """Declare every exchange, queue and binding; raise TopologyMismatch on a conflict."""
        ...

    def publisher(self) -> Publisher: ...

    def consumer(self, queue: str, *, prefetch: int) -> Consumer: ...

    def queue_depth(self, queue: str) -> int | None:
        """Messages ready in `queue` (not the unacknowledged ones), or None if it is missing."""
        ...

    def body_limit(self, size: int) -> int | None:
        """The broker's largest accepted message body, if it refuses a body of `size` bytes.

        None when a body of `size` bytes is accepted. Raises BrokerError when the broker cannot
        be asked.
        """
        ...

    def close(self) -> None:
        """Release what the broker object holds (connections are per publisher/consumer)."""
        ...

    @property
    def description(self) -> str:
        """Where the broker is, with any password masked."""
        ...
