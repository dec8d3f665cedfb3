"""`MemoryBroker`: the `Broker` protocol over one `BrokerCore`, shared with its clients."""

from __future__ import annotations

import threading
import uuid

from ...topology import Topology
from ._clients import MemoryConsumer, MemoryPublisher
from ._core import BrokerCore
from ._operator import MemoryOperator

_SHARED_LOCK = threading.Lock()
_shared: MemoryBroker | None = None


class MemoryBroker:
    """A RabbitMQ-like broker held in this process's memory; nothing in it is durable. The
    package's documentation says what it keeps and how threads share it. Once closed (also by
    leaving its ``with`` block), every operation raises BrokerConnectionError."""

    def __init__(self, *, name: str | None = None, max_message_bytes: int | None = None) -> None:
        self._core = BrokerCore(name or uuid.uuid4().hex[:12], max_message_bytes)

    @classmethod
    def shared(cls) -> MemoryBroker:
        """The broker of this process that services without an mq_url share, so that they talk
        to each other (docs/getting-started.md, "Development without servers"). A closed shared
        broker is replaced by a new one."""
        with _SHARED_LOCK:
            global _shared
            if _shared is None or _shared.closed:
                _shared = cls(name="shared")
            return _shared

    def __enter__(self) -> MemoryBroker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def description(self) -> str:
        """``memory://`` and this broker's name (a random id unless one was given)."""
        return self._core.description

    @property
    def closed(self) -> bool:
        return self._core.closed

    def declare(self, topology: Topology) -> None:
        """As the protocol says; BrokerError for an exchange type or queue mode left out here
        and for a binding to a missing exchange or queue. What was declared before an error
        stays declared, as on RabbitMQ."""
        core = self._core
        with core.open():
            for exchange in topology.exchanges:
                core.declare_exchange(exchange)
            for queue in topology.queues:
                core.declare_queue(queue)
            for binding in topology.bindings:
                core.bind(binding)

    def publisher(self) -> MemoryPublisher:
        """A new publisher. Raises BrokerConnectionError once the broker is closed."""
        with self._core.open():
            return MemoryPublisher(self._core)

    def consumer(self, queue: str, *, prefetch: int) -> MemoryConsumer:
        """A consumer of `queue` with at most `prefetch` unacknowledged deliveries (0: no limit),
        consuming from its first `fetch` on, which raises BrokerError for a missing queue."""
        with self._core.open():
            return MemoryConsumer(self._core, queue, prefetch=prefetch)

    def operator(self) -> MemoryOperator:
        with self._core.open():
            return MemoryOperator(self._core)

    def queue_depth(self, queue: str) -> int | None:
        return self._core.depth(queue)

    def body_limit(self, size: int) -> int | None:
        """`max_message_bytes` if it is below `size`, else None."""
        core = self._core
        with core.open():
            return core.max_body if core.max_body is not None and size > core.max_body else None

    def close(self) -> None:
        """Stop the timer thread, drop every message, fail waiting fetches. Idempotent."""
        self._core.close()
