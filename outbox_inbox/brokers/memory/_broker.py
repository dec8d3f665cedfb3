"""The memory broker itself: what is declared, routing, queues letting messages go (expiry,
the quorum delivery limit) and the timer thread that expires them on time."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

from ...broker import PublishOutcome, Refusal
from ...errors import BrokerConnectionError, BrokerError, TopologyMismatch
from ...messages import WireMessage
from ...topology import Binding, Exchange, Queue, Topology
from ._clients import MemoryConsumer, MemoryPublisher
from ._operator import MemoryOperator
from ._state import (
    EXCHANGE_TYPES,
    Entry,
    ExchangeState,
    QueueSettings,
    QueueState,
    Refused,
    private_copy,
    with_death,
)

log = logging.getLogger(__name__)

EXPIRED, DELIVERY_LIMIT = "expired", "delivery_limit"

_SHARED_LOCK = threading.Lock()
_shared: MemoryBroker | None = None


class MemoryBroker:
    """A RabbitMQ-like broker held in this process's memory; nothing in it is durable. The
    package's documentation says what it keeps and how threads share it. Once closed, every
    operation raises BrokerConnectionError, like a broker that went away; usable as a context
    manager that closes it."""

    def __init__(self, *, name: str | None = None, max_message_bytes: int | None = None) -> None:
        self._name = name or uuid.uuid4().hex[:12]
        # Like RabbitMQ's max_message_size: a larger body closes the publishing channel.
        self._max_body = max_message_bytes
        self._lock = threading.RLock()
        self._exchanges: dict[str, ExchangeState] = {}
        self._queues: dict[str, QueueState] = {}
        self._seq = itertools.count(1)
        self._dirty: dict[str, None] = {}  # queues to expire and dispatch, ordered set
        self._closed = False
        self._timer: threading.Thread | None = None
        self._timer_wake = threading.Condition(self._lock)
        self._timer_due: float | None = None  # when the sleeping timer wakes; None: not sleeping

    @classmethod
    def shared(cls) -> MemoryBroker:
        """The broker of this process that services without an mq_url share.

        Like a broker on the network, it is one place every service of the process reaches,
        so two services built with ``mq_url=None`` talk to each other. Pass ``broker=`` to a
        Service to keep it apart instead. A closed shared broker is replaced by a new one.
        """
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
        return f"memory://{self._name}"

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the Broker protocol -------------------------------------------------------------------

    def declare(self, topology: Topology) -> None:
        """As the protocol says; BrokerError for an exchange type or queue mode left out here
        and for a binding to a missing exchange or queue. What was declared before an error
        stays declared, as on RabbitMQ."""
        with self._open():
            for exchange in topology.exchanges:
                self._declare_exchange(exchange)
            for queue in topology.queues:
                self._declare_queue(queue)
            for binding in topology.bindings:
                self._bind(binding)

    def publisher(self) -> MemoryPublisher:
        """A new publisher. Raises BrokerConnectionError once the broker is closed."""
        with self._open():
            return MemoryPublisher(self)

    def consumer(self, queue: str, *, prefetch: int) -> MemoryConsumer:
        """A consumer of `queue` with at most `prefetch` unacknowledged deliveries (0: no limit).

        Like a RabbitMQ consumer it starts consuming at its first `fetch`, which raises
        BrokerError if the queue does not exist.
        """
        with self._open():
            return MemoryConsumer(self, queue, prefetch=prefetch)

    def operator(self) -> MemoryOperator:
        with self._open():
            return MemoryOperator(self)

    def queue_depth(self, queue: str) -> int | None:
        with self._open():
            state = self._queues.get(queue)
            if state is None:
                return None
            self._touch(state)  # expire what is due first
            return state.ready()

    def body_limit(self, size: int) -> int | None:
        """`max_message_bytes` if it is below `size`, else None."""
        with self._open():
            if self._max_body is not None and size > self._max_body:
                return self._max_body
        return None

    def close(self) -> None:
        """Stop the timer thread, drop every message, fail waiting fetches. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for state in self._queues.values():
                for consumer in state.consumers:
                    consumer.arrived.notify_all()
                state.consumers.clear()
                for ready in state.deques():
                    ready.clear()
            self._timer_wake.notify_all()
            timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)

    # -- declarations (lock held) --------------------------------------------------------------

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Hold the lock, once the broker is known to be open (else BrokerConnectionError)."""
        with self._lock:
            self._check_open()
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerConnectionError(f"the in-memory broker {self.description} is closed")

    def _declare_exchange(self, spec: Exchange) -> None:
        if spec.type not in EXCHANGE_TYPES:
            raise BrokerError(f"exchange {spec.name!r}: invalid exchange type {spec.type!r}")
        existing = self._exchanges.get(spec.name)
        if existing is None:
            self._exchanges[spec.name] = ExchangeState(spec)
            return
        difference = existing.difference(spec)
        if difference:
            raise TopologyMismatch(difference)

    def _declare_queue(self, spec: Queue) -> None:
        settings = QueueSettings.of(spec)
        existing = self._queues.get(spec.name)
        if existing is None:
            self._queues[spec.name] = QueueState(spec, settings)
            return
        difference = existing.difference(spec)
        if difference:
            raise TopologyMismatch(difference)

    def _bind(self, binding: Binding) -> None:
        exchange = self._exchanges.get(binding.exchange)
        if exchange is None:
            raise BrokerError(f"cannot bind: no exchange {binding.exchange!r}")
        if binding.queue not in self._queues:
            raise BrokerError(f"cannot bind: no queue {binding.queue!r}")
        exchange.bindings[(binding.routing_key, binding.queue)] = None

    # -- routing and queues (lock held) --------------------------------------------------------

    def _route(self, exchange: str, routing_key: str) -> list[QueueState]:
        """The queues a message published to `exchange` reaches; raises Refused (404) if the
        exchange is missing, as RabbitMQ closes the channel."""
        if exchange == "":
            state = self._queues.get(routing_key)
            return [state] if state is not None else []
        current = self._exchanges.get(exchange)
        if current is None:
            raise Refused(Refusal(404, f"NOT_FOUND - no exchange '{exchange}' in vhost '/'"))
        names = current.route(routing_key)
        if not names and current.alternate in self._exchanges:
            # What an exchange cannot route goes to its alternate (one hop, as the topology's).
            names = self._exchanges[current.alternate].route(routing_key)
        return [self._queues[name] for name in names]

    def _publish(self, message: WireMessage) -> PublishOutcome:
        """Route and enqueue one message as a mandatory publish with confirms.

        Raises Refused (a missing exchange, a body too large). A message routed to several
        queues is NACKED if any of them refused it, though the others keep their copy, as
        RabbitMQ does.
        """
        self._check_open()
        size = len(message.body)
        if self._max_body is not None and size > self._max_body:
            raise Refused(
                Refusal.of(
                    406,
                    f"PRECONDITION_FAILED - message size {size} is larger than configured "
                    f"max size {self._max_body}",
                )
            )
        targets = self._route(message.exchange, message.routing_key)
        if not targets:
            return PublishOutcome.RETURNED
        stored = private_copy(message)
        refused = [target for target in targets if not self._enqueue(target, stored)]
        self._settle()
        return PublishOutcome.NACKED if refused else PublishOutcome.CONFIRMED

    def _enqueue(self, state: QueueState, message: WireMessage) -> bool:
        """Append `message` to a queue; False if the queue is full (reject-publish)."""
        s = state.settings
        # A full classic queue refuses at the limit; a quorum queue only once it is over it.
        if s.max_length is not None and state.ready() >= s.max_length + (s.kind == "quorum"):
            return False
        entry = Entry(
            seq=next(self._seq),
            message=message,
            expires_at=time.monotonic() + s.ttl if s.ttl is not None else None,
            band=state.band_of(message.priority),
        )
        state.bands[entry.band].append(entry)
        self._dirty[state.name] = None
        if entry.expires_at is not None:
            self._wake_timer(entry.expires_at)
        return True

    def _dead_letter(self, state: QueueState, message: WireMessage, reason: str) -> None:
        """Republish a message a queue let go to its dead-letter exchange, as RabbitMQ does."""
        s = state.settings
        if s.dead_letter_exchange is None:
            return
        routing_key = s.dead_letter_routing_key or message.routing_key
        headers = with_death(
            message.headers, reason, state.name, message.exchange, message.routing_key
        )
        dead = replace(
            message, exchange=s.dead_letter_exchange, routing_key=routing_key, headers=headers
        )
        try:
            targets = self._route(s.dead_letter_exchange, routing_key)
        except Refused:  # no such exchange: RabbitMQ drops the message too
            return
        for target in targets:
            self._enqueue(target, dead)

    def _settle(self) -> None:
        """Expire and dispatch every queue that changed, until nothing moves."""
        while self._dirty:
            name = next(iter(self._dirty))
            del self._dirty[name]
            state = self._queues[name]
            self._expire(state, time.monotonic())
            self._dispatch(state)

    def _expire(self, state: QueueState, now: float) -> None:
        if state.settings.ttl is None:
            return
        for ready in state.deques():
            # Like RabbitMQ, only the head expires: a message behind it waits its turn.
            while ready and ready[0].expires_at is not None and ready[0].expires_at <= now:
                self._dead_letter(state, ready.popleft().message, EXPIRED)

    def _dispatch(self, state: QueueState) -> None:
        while state.ready():
            consumer = state.active_consumer()
            entry = state.pop() if consumer is not None else None
            if consumer is None or entry is None:
                return
            consumer.push(entry)

    # -- consumers (lock held) -----------------------------------------------------------------

    def _register(self, consumer: MemoryConsumer) -> None:
        state = self._queues.get(consumer.queue)
        if state is None:
            raise BrokerError(f"queue {consumer.queue!r} does not exist: declare the topology")
        state.consumers.append(consumer)
        self._touch(state)

    def _touch(self, state: QueueState) -> None:
        """Expire and dispatch what `state` holds now (a consumer has room, say)."""
        self._dirty[state.name] = None
        self._settle()

    def _return(
        self, queue: str, entries: list[Entry], consumer: MemoryConsumer | None = None
    ) -> None:
        """Remove `consumer` (if given) from `queue` and put its unacknowledged `entries` back,
        flagged redelivered; a quorum queue counts the return and dead-letters a message past
        its ``x-delivery-limit``."""
        state = self._queues.get(queue)
        if state is None or self._closed:
            return
        if consumer in state.consumers:
            state.consumers.remove(consumer)
        back: list[Entry] = []
        for entry in entries:
            entry.redelivered = True
            if state.settings.kind == "quorum":
                entry.returns += 1
                limit = state.settings.delivery_limit
                if limit is not None and entry.returns > limit:
                    self._dead_letter(state, entry.message, DELIVERY_LIMIT)
                    continue
            back.append(entry)
        state.requeue(back)
        self._touch(state)

    # -- the TTL timer -------------------------------------------------------------------------

    def _wake_timer(self, due: float) -> None:
        """Make sure the timer thread runs and wakes by `due` (lock held)."""
        if self._timer is None:
            self._timer = threading.Thread(
                target=self._run_timer, name=f"memory-broker-ttl-{self._name}", daemon=True
            )
            self._timer.start()
        elif self._timer_due is None or due < self._timer_due:
            self._timer_wake.notify_all()

    def _run_timer(self) -> None:
        """Expire messages at the head of TTL queues when they are due, with no one asking."""
        with self._lock:
            while not self._closed:
                try:
                    due = self._expire_due()
                except Exception:  # a bug here must not stop expiry for good: log, go on
                    log.exception("in-memory broker: expiring messages failed")
                    due = time.monotonic() + 0.1
                self._timer_due = due if due is not None else float("inf")
                timeout = None if due is None else max(0.0, due - time.monotonic())
                self._timer_wake.wait(timeout)
                self._timer_due = None

    def _expire_due(self) -> float | None:
        """Expire what is due; return when the next head message is due (lock held)."""
        timed = [state for state in self._queues.values() if state.settings.ttl is not None]
        for state in timed:
            self._dirty[state.name] = None
        self._settle()
        heads = [ready[0].expires_at for state in timed for ready in state.deques() if ready]
        return min((head for head in heads if head is not None), default=None)
