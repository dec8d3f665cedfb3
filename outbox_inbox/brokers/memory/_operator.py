"""The memory broker's operator session (the `Operator` and `QueueReader` protocols)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...broker import DIFFERS, MISSING, PRESENT, Found, Operator, PublishOutcome, QueuedMessage
from ...errors import BrokerError
from ...messages import WireMessage
from ...topology import Exchange, Queue
from ._clients import MemoryConsumer
from ._state import Entry, ExchangeState, QueueSettings, QueueState, Refused

if TYPE_CHECKING:
    from ._broker import MemoryBroker


class MemoryOperator(Operator):
    """An operator session on a `MemoryBroker` (the `Operator` protocol).

    Checks judge as a redeclare does; a reader takes messages like ``basic.get`` without ack;
    a tail consumes a private queue the session deletes when it closes.
    """

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._readers: list[MemoryQueueReader] = []
        self._tail_queues: list[str] = []

    @property
    def description(self) -> str:
        return self._broker.description

    def flow_control(self, timeout: float = 1.0) -> str | None:
        """None: nothing blocks publishers in memory. Raises BrokerConnectionError if closed."""
        with self._broker._open():
            return None

    def check_exchange(self, exchange: Exchange) -> Found:
        with self._broker._open():
            return _found(self._broker._exchanges.get(exchange.name), exchange)

    def check_queue(self, queue: Queue) -> Found:
        with self._broker._open():
            return _found(self._broker._queues.get(queue.name), queue)

    def queue_info(self, name: str) -> tuple[int, int] | None:
        with self._broker._lock:
            ready = self._broker.queue_depth(name)
            state = self._broker._queues.get(name)
            return None if ready is None or state is None else (ready, len(state.consumers))

    def purge_queue(self, name: str) -> int:
        with self._broker._open():
            state = self._broker._queues.get(name)
            if state is None:
                return 0
            count = state.ready()
            for ready in state.deques():
                ready.clear()
            return count

    def delete_queue(self, name: str) -> int:
        """Its bindings go too; returns how many messages were ready."""
        broker = self._broker
        with broker._open():
            state = broker._queues.pop(name, None)
            if state is None:
                return 0
            for exchange in broker._exchanges.values():
                for binding in [b for b in exchange.bindings if b[1] == name]:
                    del exchange.bindings[binding]
            for consumer in state.consumers:
                consumer.arrived.notify_all()
            broker._dirty.pop(name, None)
            return state.ready()

    def reader(self, queue: str) -> MemoryQueueReader:
        with self._broker._open():
            if queue not in self._broker._queues:
                raise BrokerError(f"queue {queue!r} does not exist: declare the topology")
        reader = MemoryQueueReader(self._broker, queue)
        self._readers.append(reader)
        return reader

    def tail(
        self,
        exchange: str,
        patterns: list[str],
        *,
        on_ready: Callable[[str], None],
        on_message: Callable[[WireMessage], bool],
        should_stop: Callable[[], bool],
    ) -> None:
        """Raises BrokerError if `exchange` does not exist."""
        broker = self._broker
        name = f"amq.gen-{uuid.uuid4().hex}"
        with broker._open():
            if exchange not in broker._exchanges:
                raise BrokerError(f"cannot bind a tail queue: no exchange {exchange!r}")
            broker._queues[name] = QueueState(Queue(name, durable=False), QueueSettings())
            self._tail_queues.append(name)
            for pattern in patterns:
                broker._exchanges[exchange].bindings[(pattern, name)] = None
        on_ready(name)
        consumer = MemoryConsumer(broker, name, prefetch=0)
        try:
            while not should_stop():
                deliveries = consumer.fetch(100, 0.2)
                if deliveries:
                    consumer.ack_through(deliveries[-1].tag)
                for delivery in deliveries:
                    if not on_message(delivery.message):
                        return
        finally:
            consumer.close()

    def close(self) -> None:
        """Return what the readers hold to their queues and delete the tail queues."""
        for reader in self._readers:
            reader.close()
        self._readers.clear()
        with self._broker._lock:
            if not self._broker.closed:
                for name in self._tail_queues:
                    self.delete_queue(name)
        self._tail_queues.clear()


def _found(existing: ExchangeState | QueueState | None, spec: Any) -> Found:
    if existing is None:
        return Found(MISSING)
    difference = existing.difference(spec)
    return Found(DIFFERS, difference) if difference else Found(PRESENT)


class MemoryQueueReader:
    """Takes messages from one queue of a `MemoryBroker` without acknowledging them (the
    `QueueReader` protocol). A republish is a mandatory, confirmed publish through the
    broker's exchanges; `QueuedMessage.properties` is unused (the message carries them)."""

    def __init__(self, broker: MemoryBroker, queue: str) -> None:
        self._broker = broker
        self._queue = queue
        self._taken: dict[int, Entry] = {}
        self._tags = itertools.count(1)

    @property
    def queue(self) -> str:
        return self._queue

    def depth(self) -> int:
        """Messages ready in the queue now. Raises BrokerError if it was deleted."""
        depth = self._broker.queue_depth(self._queue)
        if depth is None:
            raise BrokerError(f"queue {self._queue!r} does not exist")
        return depth

    def get(self) -> QueuedMessage | None:
        broker = self._broker
        with broker._lock:
            self.depth()  # expires what is due, raises if the queue is gone
            entry = broker._queues[self._queue].pop()
            if entry is None:
                return None
            tag = next(self._tags)
            self._taken[tag] = entry
            return QueuedMessage(tag, entry.delivered(), entry.redelivered)

    def ack(self, message: QueuedMessage) -> None:
        """Remove `message` from the queue for good. Raises BrokerError for an unknown one."""
        with self._broker._lock:
            if self._taken.pop(message.tag, None) is None:
                raise BrokerError(f"unknown delivery tag {message.tag} on {self._queue!r}")

    def republish(
        self, message: QueuedMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> bool:
        """Also raises BrokerError when the exchange is missing or a full queue refuses it."""
        copied = replace(
            message.message, exchange=exchange, routing_key=routing_key, headers=dict(headers)
        )
        with self._broker._lock:
            try:
                outcome = self._broker._publish(copied)
            except Refused as exc:
                raise BrokerError(f"republishing to {exchange or '(default)'!r}: {exc}") from exc
        if outcome is PublishOutcome.NACKED:
            raise BrokerError(f"the broker refused the copy sent to {exchange!r}")
        return outcome is PublishOutcome.CONFIRMED

    def close(self) -> None:
        broker = self._broker
        with broker._lock:
            entries = [self._taken[tag] for tag in sorted(self._taken)]
            self._taken.clear()
            broker._return(self._queue, entries)
