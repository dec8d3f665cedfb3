"""The memory broker's publisher and consumer (the `Publisher` and `Consumer` protocols)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ...broker import Delivery, PublishOutcome, Refusal
from ...errors import BrokerConnectionError, BrokerError
from ...messages import WireMessage, forwarded_headers
from ._core import BrokerCore
from ._state import Entry, Refused

log = logging.getLogger(__name__)


class MemoryPublisher:
    """Publishes into a `MemoryBroker` (the `Publisher` protocol): every message is confirmed,
    returned or nacked at once. A missing exchange or a body over `max_message_bytes` is
    REFUSED and breaks the publisher, as RabbitMQ closes the channel."""

    def __init__(self, core: BrokerCore) -> None:
        self._core = core
        self._broken = False
        self._refusal: Refusal | None = None

    @property
    def broken(self) -> bool:
        return self._broken or self._core.closed

    @property
    def refusal(self) -> Refusal | None:
        return self._refusal

    def idle(self) -> None:
        """Nothing to service: there is no connection."""

    def publish_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> list[PublishOutcome]:
        """Publish in order; `timeout` does not matter, since confirms are immediate."""
        if self.broken:
            return [PublishOutcome.FAILED] * len(messages)
        outcomes: list[PublishOutcome] = []
        failed_keys: set[str] = set()
        for index, message in enumerate(messages):
            key = message.key
            if key is not None and key in failed_keys:
                outcomes.append(PublishOutcome.SKIPPED)
                continue
            try:
                with self._core.lock:
                    outcome = self._core.publish(message)
            except Refused as exc:
                log.warning("in-memory publishing channel closed: %s", exc.refusal)
                self._broken = True
                self._refusal = exc.refusal
                outcomes.append(PublishOutcome.REFUSED)
                outcomes.extend([PublishOutcome.SKIPPED] * (len(messages) - index - 1))
                break
            except BrokerConnectionError as exc:
                log.warning("in-memory publisher broken: %s", exc)
                self._broken = True
                outcomes.extend([PublishOutcome.FAILED] * (len(messages) - index))
                break
            outcomes.append(outcome)
            if key is not None and outcome is PublishOutcome.NACKED:
                failed_keys.add(key)
        return outcomes

    def close(self) -> None:
        """Later batches are FAILED, like a publisher whose connection is closed."""
        self._broken = True


class MemoryConsumer:
    """Consumes one queue of a `MemoryBroker`, as RabbitMQ pushes to a consumer: up to
    `prefetch` unacknowledged at a time, from its first `fetch` on, tags from 1. Each delivery
    is a deep copy, so what one consumer does to a message no one else sees."""

    def __init__(self, core: BrokerCore, queue: str, *, prefetch: int) -> None:
        self._core, self.queue, self._prefetch = core, queue, prefetch
        self._registered = False
        self._closed = False
        self._next_tag = 1
        self._unacked: dict[int, Entry] = {}  # delivered, not acknowledged; in tag order
        self._unfetched: deque[int] = deque()  # tags handed over that `fetch` has not returned
        self.arrived = threading.Condition(core.lock)

    # Called by the broker with its lock held.

    def has_capacity(self) -> bool:
        return self._prefetch == 0 or len(self._unacked) < self._prefetch

    def push(self, entry: Entry) -> None:
        tag = self._next_tag
        self._next_tag += 1
        self._unacked[tag] = entry
        self._unfetched.append(tag)
        self.arrived.notify_all()

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """As the protocol says. Raises BrokerError if the queue does not exist."""
        core = self._core
        with core.lock:
            self._check_usable()
            if not self._registered:
                core.register(self)
                self._registered = True
            deadline = time.monotonic() + wait
            while not self._unfetched:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self.arrived.wait(remaining)
                self._check_usable()
            tags = [self._unfetched.popleft() for _ in range(min(max_count, len(self._unfetched)))]
            entries = [(tag, self._unacked[tag]) for tag in tags]
            return [Delivery(entry.delivered(), tag, entry.redelivered) for tag, entry in entries]

    def ack_through(self, tag: int) -> None:
        """An unknown tag closes the consumer, its deliveries requeued, and raises
        BrokerConnectionError, as RabbitMQ closes the channel (PRECONDITION_FAILED)."""
        with self._core.lock:
            self._settle_tags(tag, [t for t in self._unacked if t <= tag])

    def ack(self, tag: int) -> None:
        """Acknowledge one delivery; an unknown tag is handled as by `ack_through`."""
        with self._core.lock:
            self._settle_tags(tag, [tag])

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        """As the protocol says; a missing exchange raises BrokerConnectionError (RabbitMQ
        closes the channel), a full queue BrokerError."""
        core = self._core
        with core.lock:
            self._settle_tags(delivery.tag, [])  # checks the tag
            outgoing = replace(
                delivery.message,
                exchange=exchange,
                routing_key=routing_key,
                headers=forwarded_headers(delivery.message, headers),
                key=None,
            )
            try:
                outcome = core.publish(outgoing)
            except Refused as exc:
                raise BrokerConnectionError(f"forwarding failed: {exc}") from exc
            if outcome is PublishOutcome.RETURNED:
                raise BrokerError(
                    f"cannot forward to {exchange or '(default)'}/{routing_key}: no queue; "
                    "declare the topology"
                )
            if outcome is PublishOutcome.NACKED:
                raise BrokerError(
                    f"the broker refused a forwarded message to {exchange or '(default)'}/"
                    f"{routing_key} (a full queue with reject-publish)"
                )
            self._settle_tags(delivery.tag, [delivery.tag])

    def close(self) -> None:
        """Stop consuming; unacknowledged deliveries go back to their place in the queue, flagged
        redelivered (`BrokerCore.give_back`). Never raises."""
        with self._core.lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    # Internals, lock held.

    def _check_usable(self) -> None:
        self._core.check_open()
        if self._closed:
            raise BrokerConnectionError(f"the consumer of {self.queue!r} is closed")

    def _settle_tags(self, tag: int, tags: list[int]) -> None:
        """Acknowledge `tags` once `tag` is known to be unacknowledged (see `ack_through`)."""
        self._check_usable()
        if tag not in self._unacked:
            self._channel_error(f"unknown delivery tag {tag}")
        if not tags:
            return
        for acked in tags:
            del self._unacked[acked]
        if self._unfetched:
            self._unfetched = deque(t for t in self._unfetched if t in self._unacked)
        state = self._core.queues.get(self.queue)
        if state is not None:
            self._core.touch(state)

    def _release(self) -> None:
        entries = [self._unacked[tag] for tag in sorted(self._unacked)]
        self._unacked.clear()
        self._unfetched.clear()
        if self._registered:
            self._core.give_back(self.queue, entries, self)
        self.arrived.notify_all()

    def _channel_error(self, reason: str) -> None:
        self._closed = True
        self._release()
        raise BrokerConnectionError(
            f"{reason} on the consumer of {self.queue!r}: the channel is closed, its deliveries "
            "requeued (RabbitMQ: PRECONDITION_FAILED)"
        )
