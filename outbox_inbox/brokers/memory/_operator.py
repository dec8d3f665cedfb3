"""The memory broker's operator session (the `Operator` and `QueueReader` protocols)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ...broker import DIFFERS, MISSING, PRESENT, Found, Operator, PublishOutcome, QueuedMessage
from ...errors import BrokerError
from ...messages import WireMessage
from ...topology import Exchange, Queue
from ._clients import MemoryConsumer
from ._core import BrokerCore
from ._state import Entry, ExchangeState, QueueSettings, QueueState, Refused


class MemoryOperator(Operator):
    """An operator session on a `MemoryBroker` (the `Operator` protocol): checks judge as a
    redeclare does; a reader takes messages like ``basic.get`` without ack; a tail consumes a
    private queue the session deletes when it closes."""

    def __init__(self, core: BrokerCore) -> None:
        self._core = core
        self._readers: list[MemoryQueueReader] = []
        self._tail_queues: list[str] = []

    @property
    def description(self) -> str:
        return self._core.description

    def flow_control(self, timeout: float = 1.0) -> str | None:
        """None: nothing blocks publishers in memory. Raises BrokerConnectionError if closed."""
        with self._core.open():
            return None

    def check_exchange(self, exchange: Exchange) -> Found:
        with self._core.open():
            return _found(self._core.exchanges.get(exchange.name), exchange)

    def check_queue(self, queue: Queue) -> Found:
        with self._core.open():
            return _found(self._core.queues.get(queue.name), queue)

    def queue_info(self, name: str) -> tuple[int, int] | None:
        with self._core.lock:
            ready = self._core.depth(name)
            state = self._core.queues.get(name)
            return None if ready is None or state is None else (ready, len(state.consumers))

    def purge_queue(self, name: str) -> int:
        with self._core.open():
            state = self._core.queues.get(name)
            if state is None:
                return 0
            count = state.ready()
            for ready in state.deques():
                ready.clear()
            return count

    def delete_queue(self, name: str) -> int:
        """Its bindings go too; returns how many messages were ready."""
        core = self._core
        with core.open():
            state = core.queues.pop(name, None)
            if state is None:
                return 0
            for exchange in core.exchanges.values():
                exchange.bindings = {b: None for b in exchange.bindings if b[1] != name}
            for consumer in state.consumers:
                consumer.arrived.notify_all()
            core.dirty.pop(name, None)
            return state.ready()

    def reader(self, queue: str) -> MemoryQueueReader:
        with self._core.open():
            if queue not in self._core.queues:
                raise BrokerError(f"queue {queue!r} does not exist: declare the topology")
        reader = MemoryQueueReader(self._core, queue)
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
        core = self._core
        name = f"amq.gen-{uuid.uuid4().hex}"
        with core.open():
            if exchange not in core.exchanges:
                raise BrokerError(f"cannot bind a tail queue: no exchange {exchange!r}")
            core.queues[name] = QueueState(Queue(name, durable=False), QueueSettings())
            self._tail_queues.append(name)
            for pattern in patterns:
                core.exchanges[exchange].bindings[(pattern, name)] = None
        on_ready(name)
        consumer = MemoryConsumer(core, name, prefetch=0)
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
        with self._core.lock:
            if not self._core.closed:
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

    def __init__(self, core: BrokerCore, queue: str) -> None:
        self._core, self._queue = core, queue
        self._taken: dict[int, Entry] = {}
        self._tags = itertools.count(1)

    @property
    def queue(self) -> str:
        return self._queue

    def depth(self) -> int:
        """Messages ready in the queue now. Raises BrokerError if it was deleted."""
        depth = self._core.depth(self._queue)
        if depth is None:
            raise BrokerError(f"queue {self._queue!r} does not exist")
        return depth

    def get(self) -> QueuedMessage | None:
        core = self._core
        with core.lock:
            self.depth()  # expires what is due, raises if the queue is gone
            entry = core.queues[self._queue].pop()
            if entry is None:
                return None
            tag = next(self._tags)
            self._taken[tag] = entry
            return QueuedMessage(tag, entry.delivered(), entry.redelivered)

    def ack(self, message: QueuedMessage) -> None:
        """Remove `message` from the queue for good. Raises BrokerError for an unknown one."""
        with self._core.lock:
            if self._taken.pop(message.tag, None) is None:
                raise BrokerError(f"unknown delivery tag {message.tag} on {self._queue!r}")

    def republish(
        self, message: QueuedMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> bool:
        """Also raises BrokerError when the exchange is missing or a full queue refuses it."""
        copied = replace(
            message.message, exchange=exchange, routing_key=routing_key, headers=dict(headers)
        )
        with self._core.lock:
            try:
                outcome = self._core.publish(copied)
            except Refused as exc:
                raise BrokerError(f"republishing to {exchange or '(default)'!r}: {exc}") from exc
        if outcome is PublishOutcome.NACKED:
            raise BrokerError(f"the broker refused the copy sent to {exchange!r}")
        return outcome is PublishOutcome.CONFIRMED

    def close(self) -> None:
        core = self._core
        with core.lock:
            entries = [self._taken[tag] for tag in sorted(self._taken)]
            self._taken.clear()
            core.give_back(self._queue, entries)
