"""The memory broker's state and what moves messages: what is declared, routing, queues letting
messages go (expiry, the quorum delivery limit) and the timer thread that expires them on time.
One `BrokerCore` is one broker: `MemoryBroker` and every publisher, consumer and operator
session it makes are handed it, and hold its `lock` while they use it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from ...broker import PublishOutcome, Refusal
from ...errors import BrokerConnectionError, BrokerError, TopologyMismatch
from ...messages import WireMessage
from ...topology import Binding, Exchange, Queue
from ._state import (
    EXCHANGE_TYPES,
    Entry,
    ExchangeState,
    QueueSettings,
    QueueState,
    Refused,
    Subscriber,
    private_copy,
    with_death,
)

log = logging.getLogger(__name__)

EXPIRED, DELIVERY_LIMIT = "expired", "delivery_limit"


class BrokerCore:
    """The state of one in-memory broker, behind one lock (`lock`, reentrant). Methods whose
    docstring or section says "lock held" expect the caller to hold it."""

    def __init__(self, name: str, max_message_bytes: int | None) -> None:
        self.description = f"memory://{name}"
        self._name = name
        # Like RabbitMQ's max_message_size: a larger body closes the publishing channel.
        self.max_body = max_message_bytes
        self.lock = threading.RLock()
        self.exchanges: dict[str, ExchangeState] = {}
        self.queues: dict[str, QueueState] = {}
        self._seq = itertools.count(1)
        self.dirty: dict[str, None] = {}  # queues to expire and dispatch, ordered set
        self.closed = False
        self._timer: threading.Thread | None = None
        self._timer_wake = threading.Condition(self.lock)
        self._timer_due: float | None = None  # when the sleeping timer wakes; None: not sleeping

    def close(self) -> None:
        """Stop the timer thread, drop every message, fail waiting fetches. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for state in self.queues.values():
                for consumer in state.consumers:
                    consumer.arrived.notify_all()
                state.consumers.clear()
                for ready in state.deques():
                    ready.clear()
            self._timer_wake.notify_all()
            timer = self._timer
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=5)

    def depth(self, queue: str) -> int | None:
        """Messages ready in `queue` once what is due expired, or None if it does not exist."""
        with self.open():
            state = self.queues.get(queue)
            if state is None:
                return None
            self.touch(state)
            return state.ready()

    # -- declarations (lock held) --------------------------------------------------------------

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """Hold the lock, once the broker is known to be open (else BrokerConnectionError)."""
        with self.lock:
            self.check_open()
            yield

    def check_open(self) -> None:
        if self.closed:
            raise BrokerConnectionError(f"the in-memory broker {self.description} is closed")

    def declare_exchange(self, spec: Exchange) -> None:
        if spec.type not in EXCHANGE_TYPES:
            raise BrokerError(f"exchange {spec.name!r}: invalid exchange type {spec.type!r}")
        existing = self.exchanges.setdefault(spec.name, ExchangeState(spec))
        if difference := existing.difference(spec):
            raise TopologyMismatch(difference)

    def declare_queue(self, spec: Queue) -> None:
        existing = self.queues.setdefault(spec.name, QueueState(spec, QueueSettings.of(spec)))
        if difference := existing.difference(spec):
            raise TopologyMismatch(difference)

    def bind(self, binding: Binding) -> None:
        exchange = self.exchanges.get(binding.exchange)
        if exchange is None:
            raise BrokerError(f"cannot bind: no exchange {binding.exchange!r}")
        if binding.queue not in self.queues:
            raise BrokerError(f"cannot bind: no queue {binding.queue!r}")
        exchange.bindings[(binding.routing_key, binding.queue)] = None

    # -- routing and queues (lock held) --------------------------------------------------------

    def route(self, exchange: str, routing_key: str) -> list[QueueState]:
        """The queues a message published to `exchange` reaches; raises Refused (404) if the
        exchange is missing, as RabbitMQ closes the channel."""
        if exchange == "":
            state = self.queues.get(routing_key)
            return [state] if state is not None else []
        current = self.exchanges.get(exchange)
        if current is None:
            raise Refused(Refusal(404, f"NOT_FOUND - no exchange '{exchange}' in vhost '/'"))
        names = current.route(routing_key)
        if not names and current.alternate in self.exchanges:
            # What an exchange cannot route goes to its alternate (one hop, as the topology's).
            names = self.exchanges[current.alternate].route(routing_key)
        return [self.queues[name] for name in names]

    def publish(self, message: WireMessage) -> PublishOutcome:
        """Route and enqueue one message as a mandatory publish with confirms. Raises Refused
        (a missing exchange, a body too large). Routed to several queues, it is NACKED if any
        refused it, the others keeping their copy, as RabbitMQ does."""
        self.check_open()
        size = len(message.body)
        if self.max_body is not None and size > self.max_body:
            raise Refused(
                Refusal.of(
                    406,
                    f"PRECONDITION_FAILED - message size {size} is larger than configured "
                    f"max size {self.max_body}",
                )
            )
        targets = self.route(message.exchange, message.routing_key)
        if not targets:
            return PublishOutcome.RETURNED
        stored = private_copy(message)
        refused = [target for target in targets if not self.enqueue(target, stored)]
        self.settle()
        return PublishOutcome.NACKED if refused else PublishOutcome.CONFIRMED

    def enqueue(self, state: QueueState, message: WireMessage) -> bool:
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
        self.dirty[state.name] = None
        if entry.expires_at is not None:
            self._wake_timer(entry.expires_at)
        return True

    def dead_letter(self, state: QueueState, message: WireMessage, reason: str) -> None:
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
            targets = self.route(s.dead_letter_exchange, routing_key)
        except Refused:  # no such exchange: RabbitMQ drops the message too
            return
        for target in targets:
            self.enqueue(target, dead)

    def settle(self) -> None:
        """Expire and dispatch every queue that changed, until nothing moves."""
        while self.dirty:
            name = next(iter(self.dirty))
            del self.dirty[name]
            state = self.queues[name]
            self.expire(state, time.monotonic())
            self.dispatch(state)

    def expire(self, state: QueueState, now: float) -> None:
        if state.settings.ttl is None:
            return
        for ready in state.deques():
            # Like RabbitMQ, only the head expires: a message behind it waits its turn.
            while ready and ready[0].expires_at is not None and ready[0].expires_at <= now:
                self.dead_letter(state, ready.popleft().message, EXPIRED)

    def dispatch(self, state: QueueState) -> None:
        while state.ready():
            consumer = state.active_consumer()
            entry = state.pop() if consumer is not None else None
            if consumer is None or entry is None:
                return
            consumer.push(entry)

    # -- consumers (lock held) -----------------------------------------------------------------

    def register(self, consumer: Subscriber) -> None:
        state = self.queues.get(consumer.queue)
        if state is None:
            raise BrokerError(f"queue {consumer.queue!r} does not exist: declare the topology")
        state.consumers.append(consumer)
        self.touch(state)

    def touch(self, state: QueueState) -> None:
        """Expire and dispatch what `state` holds now (a consumer has room, say)."""
        self.dirty[state.name] = None
        self.settle()

    def give_back(
        self, queue: str, entries: list[Entry], consumer: Subscriber | None = None
    ) -> None:
        """Remove `consumer` (if given) from `queue` and put its unacknowledged `entries` back,
        flagged redelivered; a quorum queue counts the return and dead-letters a message past
        its ``x-delivery-limit``."""
        state = self.queues.get(queue)
        if state is None or self.closed:
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
                    self.dead_letter(state, entry.message, DELIVERY_LIMIT)
                    continue
            back.append(entry)
        state.requeue(back)
        self.touch(state)

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
        with self.lock:
            while not self.closed:
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
        timed = [state for state in self.queues.values() if state.settings.ttl is not None]
        for state in timed:
            self.dirty[state.name] = None
        self.settle()
        heads = [ready[0].expires_at for state in timed for ready in state.deques() if ready]
        return min((head for head in heads if head is not None), default=None)
