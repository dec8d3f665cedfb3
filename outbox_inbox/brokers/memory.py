"""An in-memory message broker that behaves like RabbitMQ 3.10, for development and demos.

One `MemoryBroker` object is one broker: the services of one process that are given the same
object talk to each other through it, exactly as they would through one RabbitMQ server. It
needs no server, which makes it right for development, demos and users' own tests, and wrong
for anything else: **nothing is durable**. Every message lives in this process's memory only;
it is gone when the process ends or the broker is closed, so the outbox/inbox guarantees stop
at the broker. Use RabbitMQ in production.

What it does, as RabbitMQ 3.10 does it (the shared contract suite in ``tests/contract`` runs the
same assertions on both):

* exchanges ``direct``, ``fanout``, ``topic`` (``*`` one word, ``#`` zero or more) and
  ``headers`` (bindings carry no arguments, so a headers exchange routes to every bound queue);
  the default exchange ``""`` routes to the queue named by the routing key; the
  ``alternate-exchange`` argument takes what an exchange cannot route;
* queues with ``x-message-ttl`` (messages expire at the head, on time, with no consumer needed),
  ``x-dead-letter-exchange`` / ``x-dead-letter-routing-key`` (with ``x-death`` and
  ``x-first-death-*`` headers, and RabbitMQ's dead-letter cycle detection), ``x-max-length``
  with ``x-overflow`` ``drop-head`` / ``reject-publish`` / ``reject-publish-dlx``,
  ``x-max-priority``, ``x-single-active-consumer``, and ``x-queue-type`` ``classic`` or
  ``quorum`` (quorum queues count returns in ``x-delivery-count`` and honour
  ``x-delivery-limit``);
* a redeclare with other properties raises TopologyMismatch, judged on the same arguments
  RabbitMQ compares; invalid arguments raise TopologyMismatch too (RabbitMQ answers both with
  PRECONDITION_FAILED);
* publishers with confirms and mandatory returns; consumers with a prefetch window, per-consumer
  delivery tags from 1, and unacknowledged deliveries requeued at their original place, flagged
  redelivered, when the consumer closes.

Arguments RabbitMQ knows that are not implemented here (``x-expires``, ``x-max-length-bytes``,
``x-queue-mode``, ...) are accepted and ignored with a warning. Stream queues are refused.

Thread safety: a `MemoryBroker` may be shared by any number of threads; all its state sits
behind one lock. One daemon timer thread per broker expires TTL messages; `MemoryBroker.close`
stops it. Publishers and consumers follow the `outbox_inbox.broker` rule (one per thread),
though they are safe to call from several threads.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from ..broker import (
    DIFFERS,
    MISSING,
    PRESENT,
    Delivery,
    Found,
    PublishOutcome,
    QueuedMessage,
    Refusal,
)
from ..errors import (
    BrokerConnectionError,
    BrokerError,
    ConfigurationError,
    MessageError,
    TopologyMismatch,
)
from ..messages import H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY, WireMessage
from ..topology import Binding, Exchange, Queue, Topology, topic_matches

log = logging.getLogger(__name__)

EXCHANGE_TYPES = frozenset({"direct", "fanout", "topic", "headers"})
OVERFLOW_MODES = frozenset({"drop-head", "reject-publish", "reject-publish-dlx"})

#: The queue arguments RabbitMQ 3.10 compares when a queue is declared again
#: (``rabbit_amqqueue:declare_args/0``); any other argument may differ without an error.
EQUIVALENCE_ARGUMENTS = (
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-single-active-consumer",
    "x-queue-type",
    "x-quorum-initial-group-size",
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-initial-cluster-size",
    "x-queue-leader-locator",
)
#: Quorum queues compare their delivery limit as well.
QUORUM_EQUIVALENCE_ARGUMENTS = (*EQUIVALENCE_ARGUMENTS, "x-delivery-limit")

#: Arguments RabbitMQ accepts that change nothing this broker could show: accepted, warned about.
IGNORED_ARGUMENTS = frozenset(
    {
        "x-expires",
        "x-max-length-bytes",
        "x-max-in-memory-length",
        "x-max-in-memory-bytes",
        "x-queue-mode",
        "x-queue-master-locator",
        "x-queue-leader-locator",
        "x-quorum-initial-group-size",
        "x-initial-cluster-size",
        "x-dead-letter-strategy",
    }
)

#: Header a quorum queue adds to a message it delivers again (RabbitMQ 3.10).
H_DELIVERY_COUNT = "x-delivery-count"

EXPIRED, MAXLEN, DELIVERY_LIMIT = "expired", "maxlen", "delivery_limit"


class _Refused(Exception):
    """The broker refuses a publish as RabbitMQ does, by closing the channel."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


class _NoExchange(_Refused):
    """A publish named an exchange that does not exist (RabbitMQ closes the channel: 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(Refusal(404, f"NOT_FOUND - no exchange '{name}' in vhost '/'"))
        self.name = name


# --------------------------------------------------------------------------------------------
# Declared objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _QueueSettings:
    """What a queue's arguments mean, validated like RabbitMQ 3.10 validates them."""

    kind: str = "classic"
    ttl: float | None = None  # seconds
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    max_length: int | None = None
    overflow: str = "drop-head"
    max_priority: int | None = None
    single_active_consumer: bool = False
    delivery_limit: int | None = None


@dataclass(eq=False)
class _Entry:
    """One message in one queue."""

    seq: int  # arrival order in the broker: a requeued message goes back to its place by it
    message: WireMessage  # as routed; the broker never changes it, deliveries get copies
    expires_at: float | None  # monotonic; kept when requeued, as RabbitMQ keeps it
    band: int = 0  # priority band
    redelivered: bool = False
    returns: int = 0  # times returned to a quorum queue: its x-delivery-count


class _ExchangeState:
    def __init__(self, spec: Exchange) -> None:
        self.spec = spec
        alternate = spec.arguments.get("alternate-exchange")
        self.alternate: str | None = alternate if isinstance(alternate, str) else None
        self.bindings: dict[tuple[str, str], None] = {}  # (routing key, queue), ordered set

    def route(self, routing_key: str) -> list[str]:
        """The queues bound for `routing_key`, each once, in binding order."""
        kind = self.spec.type
        matched: dict[str, None] = {}
        for pattern, queue in self.bindings:
            if (
                kind in ("fanout", "headers")
                or (kind == "direct" and pattern == routing_key)
                or (kind == "topic" and topic_matches(pattern, routing_key))
            ):
                matched[queue] = None
        return list(matched)


class _QueueState:
    def __init__(self, spec: Queue, settings: _QueueSettings) -> None:
        self.spec = spec
        self.settings = settings
        bands = (settings.max_priority or 0) + 1
        self.bands: list[deque[_Entry]] = [deque() for _ in range(bands)]
        # A quorum queue serves returned messages first, in the order they came back.
        self.returned: deque[_Entry] = deque()
        self.consumers: list[MemoryConsumer] = []  # registration order
        self.next_consumer = 0  # round robin

    @property
    def name(self) -> str:
        return self.spec.name

    def ready(self) -> int:
        return len(self.returned) + sum(len(band) for band in self.bands)

    def deques(self) -> Iterator[deque[_Entry]]:
        """Every deque of ready messages, in delivery order: returns, then priority high to low."""
        yield self.returned
        yield from reversed(self.bands)

    def band_of(self, priority: int | None) -> int:
        if self.settings.max_priority is None:
            return 0
        return min(priority or 0, self.settings.max_priority)

    def pop(self) -> _Entry | None:
        for ready in self.deques():
            if ready:
                return ready.popleft()
        return None

    def requeue(self, entries: list[_Entry]) -> None:
        """Put entries back: a quorum queue serves them next, a classic one at their old place."""
        if self.settings.kind == "quorum":
            self.returned.extend(entries)
            return
        for band_number, band in enumerate(self.bands):
            back = sorted((e for e in entries if e.band == band_number), key=lambda e: e.seq)
            if not back:
                continue
            if not band or back[-1].seq < band[0].seq:
                band.extendleft(reversed(back))
            else:
                merged = sorted([*band, *back], key=lambda e: e.seq)
                band.clear()
                band.extend(merged)

    def active_consumer(self) -> MemoryConsumer | None:
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


# --------------------------------------------------------------------------------------------
# The broker
# --------------------------------------------------------------------------------------------


_SHARED_LOCK = threading.Lock()
_shared: MemoryBroker | None = None


class MemoryBroker:
    """A RabbitMQ-like broker held in this process's memory. Nothing in it is durable.

    Share one instance between the services that should talk to each other. Thread-safe: every
    method may be called from any thread. `close()` stops the TTL timer thread and drops every
    message; afterwards every operation raises BrokerConnectionError, like a broker that went
    away. Usable as a context manager that closes it.
    """

    def __init__(self, *, name: str | None = None, max_message_bytes: int | None = None) -> None:
        self._name = name or uuid.uuid4().hex[:12]
        # Like RabbitMQ's max_message_size: a larger body closes the publishing channel.
        self._max_body = max_message_bytes
        self._lock = threading.RLock()
        self._exchanges: dict[str, _ExchangeState] = {}
        self._queues: dict[str, _QueueState] = {}
        self._seq = itertools.count(1)
        self._dirty: dict[str, None] = {}  # queues to expire and dispatch, ordered set
        self._closed = False
        self._timer: threading.Thread | None = None
        self._timer_wake = threading.Condition(self._lock)
        self._timer_due: float | None = None  # when the sleeping timer wakes; None: not sleeping

    def __repr__(self) -> str:
        return f"<MemoryBroker {self.description}>"

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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
        """Declare every exchange, queue and binding; declaring the same again changes nothing.

        Raises TopologyMismatch when an object exists with other properties or an argument is
        invalid, BrokerError for what RabbitMQ refuses otherwise (reserved ``amq.`` names, the
        default exchange, an unknown exchange type, a binding to a missing exchange or queue).
        Like RabbitMQ, what was declared before the error stays declared.
        """
        with self._lock:
            self._check_open()
            for exchange in topology.exchanges:
                self._declare_exchange(exchange)
            for queue in topology.queues:
                self._declare_queue(queue)
            for binding in topology.bindings:
                self._bind(binding)

    def publisher(self) -> MemoryPublisher:
        """A new publisher. Raises BrokerConnectionError once the broker is closed."""
        with self._lock:
            self._check_open()
        return MemoryPublisher(self)

    def consumer(self, queue: str, *, prefetch: int) -> MemoryConsumer:
        """A consumer of `queue` with at most `prefetch` unacknowledged deliveries (0: no limit).

        Like a RabbitMQ consumer it starts consuming at its first `fetch`, which raises
        BrokerError if the queue does not exist.
        """
        if prefetch < 0:
            raise ConfigurationError("prefetch must be >= 0")
        with self._lock:
            self._check_open()
        return MemoryConsumer(self, queue, prefetch=prefetch)

    def operator(self) -> MemoryOperator:
        """An operator session on this broker. Raises BrokerConnectionError once it is closed."""
        with self._lock:
            self._check_open()
        return MemoryOperator(self)

    def queue_depth(self, queue: str) -> int | None:
        """Messages ready in `queue` (not those delivered and unacknowledged), None if no queue."""
        with self._lock:
            self._check_open()
            state = self._queues.get(queue)
            if state is None:
                return None
            self._dirty[queue] = None  # expire what is due first
            self._settle()
            return state.ready()

    def body_limit(self, size: int) -> int | None:
        """`max_message_bytes` if it is below `size`, else None."""
        with self._lock:
            self._check_open()
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

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerConnectionError(f"the in-memory broker {self.description} is closed")

    def _declare_exchange(self, spec: Exchange) -> None:
        what = f"exchange {spec.name!r}"
        if spec.name == "":
            raise BrokerError("declaring the default exchange is not permitted")
        if spec.name.startswith("amq."):
            raise BrokerError(f"{what}: the name prefix 'amq.' is reserved")
        if spec.type not in EXCHANGE_TYPES:
            raise BrokerError(f"{what}: invalid exchange type {spec.type!r}")
        alternate = spec.arguments.get("alternate-exchange")
        if alternate is not None and not isinstance(alternate, str):
            raise TopologyMismatch(f"{what}: invalid argument 'alternate-exchange' {alternate!r}")
        existing = self._exchanges.get(spec.name)
        if existing is None:
            self._exchanges[spec.name] = _ExchangeState(_frozen_exchange(spec))
            return
        difference = _exchange_difference(existing, spec)
        if difference:
            raise TopologyMismatch(difference)

    def _declare_queue(self, spec: Queue) -> None:
        what = f"queue {spec.name!r}"
        if spec.name == "":
            raise BrokerError(
                "server-named queues (an empty name) are not supported by the in-memory broker"
            )
        if spec.name.startswith("amq."):
            raise BrokerError(f"{what}: the name prefix 'amq.' is reserved")
        settings = _queue_settings(spec)
        existing = self._queues.get(spec.name)
        if existing is not None:
            difference = _queue_difference(existing.spec, spec, existing.settings.kind)
            if difference:
                raise TopologyMismatch(difference)
            return
        ignored = sorted(IGNORED_ARGUMENTS.intersection(spec.arguments))
        if ignored:
            log.warning(
                "in-memory broker: %s: arguments %s are not implemented and are ignored",
                what,
                ignored,
                extra={"queue": spec.name, "arguments": ignored},
            )
        self._queues[spec.name] = _QueueState(_frozen_queue(spec), settings)

    def _bind(self, binding: Binding) -> None:
        if binding.exchange == "":
            raise BrokerError("binding to the default exchange is not permitted")
        exchange = self._exchanges.get(binding.exchange)
        if exchange is None:
            raise BrokerError(f"cannot bind: no exchange {binding.exchange!r}")
        if binding.queue not in self._queues:
            raise BrokerError(f"cannot bind: no queue {binding.queue!r}")
        exchange.bindings[(binding.routing_key, binding.queue)] = None

    # -- routing and queues (lock held) --------------------------------------------------------

    def _route(self, exchange: str, routing_key: str) -> list[_QueueState]:
        """The queues a message published to `exchange` reaches; raises _NoExchange."""
        if exchange == "":
            state = self._queues.get(routing_key)
            return [state] if state is not None else []
        current = self._exchanges.get(exchange)
        if current is None:
            raise _NoExchange(exchange)
        seen: set[str] = set()
        while current is not None and current.spec.name not in seen:
            seen.add(current.spec.name)
            names = current.route(routing_key)
            if names:
                return [self._queues[name] for name in names]
            # What an exchange cannot route goes to its alternate, if that exists.
            current = self._exchanges.get(current.alternate) if current.alternate else None
        return []

    def _publish(self, message: WireMessage) -> PublishOutcome:
        """Route and enqueue one message as a mandatory publish with confirms.

        Raises _Refused (_NoExchange for a missing exchange). A message routed to several
        queues is NACKED if any of them refused it, though the others keep their copy, as
        RabbitMQ does.
        """
        self._check_open()
        size = len(message.body)
        if self._max_body is not None and size > self._max_body:
            raise _Refused(
                Refusal.of(
                    406,
                    f"PRECONDITION_FAILED - message size {size} is larger than configured "
                    f"max size {self._max_body}",
                )
            )
        if message.priority is not None and not 0 <= message.priority <= 255:
            raise MessageError(f"priority {message.priority} is outside 0..255")
        targets = self._route(message.exchange, message.routing_key)
        if not targets:
            return PublishOutcome.RETURNED
        stored = _private_copy(message)
        refused = False
        for target in targets:
            if not self._enqueue(target, stored):
                refused = True
        self._settle()
        return PublishOutcome.NACKED if refused else PublishOutcome.CONFIRMED

    def _enqueue(self, state: _QueueState, message: WireMessage) -> bool:
        """Append `message` to a queue; False if the queue refused it (reject-publish)."""
        s = state.settings
        if s.max_length is not None and s.overflow != "drop-head":
            ready = state.ready()
            # A classic queue refuses at the limit; a quorum queue only once it is over it.
            full = ready > s.max_length if s.kind == "quorum" else ready >= s.max_length
            if full:
                if s.overflow == "reject-publish-dlx":
                    self._dead_letter(state, message, MAXLEN)
                return False
        now = time.monotonic()
        entry = _Entry(
            seq=next(self._seq),
            message=message,
            expires_at=now + s.ttl if s.ttl is not None else None,
            band=state.band_of(message.priority),
        )
        if not state.ready():
            # A message that a consumer can take at once is delivered, never expired: RabbitMQ's
            # rule, which makes a TTL of 0 mean "deliver now or dead-letter".
            consumer = state.active_consumer()
            if consumer is not None:
                consumer.push(entry)
                return True
        state.bands[entry.band].append(entry)
        if s.max_length is not None and s.overflow == "drop-head":
            while state.ready() > s.max_length:
                dropped = state.pop()
                if dropped is not None:
                    self._dead_letter(state, dropped.message, MAXLEN)
        self._dirty[state.name] = None
        if entry.expires_at is not None:
            self._wake_timer(entry.expires_at)
        return True

    def _dead_letter(self, state: _QueueState, message: WireMessage, reason: str) -> None:
        """Republish a message a queue let go to its dead-letter exchange, as RabbitMQ does."""
        s = state.settings
        if s.dead_letter_exchange is None:
            return
        routing_key = (
            s.dead_letter_routing_key
            if s.dead_letter_routing_key is not None
            else message.routing_key
        )
        headers = _with_death(
            message.headers, reason, state.name, message.exchange, message.routing_key
        )
        dead = replace(
            message, exchange=s.dead_letter_exchange, routing_key=routing_key, headers=headers
        )
        try:
            targets = self._route(s.dead_letter_exchange, routing_key)
        except _NoExchange:
            log.warning(
                "in-memory broker: dead-letter exchange %r of queue %r does not exist; "
                "message %s dropped",
                s.dead_letter_exchange,
                state.name,
                message.message_id,
            )
            return
        deaths = headers["x-death"]
        for target in targets:
            if _is_cycle(target.name, deaths):
                log.warning(
                    "in-memory broker: dead-letter cycle through queue %r; message %s dropped",
                    target.name,
                    message.message_id,
                )
                continue
            self._enqueue(target, dead)

    def _settle(self) -> None:
        """Expire and dispatch every queue that changed, until nothing moves."""
        while self._dirty:
            name = next(iter(self._dirty))
            del self._dirty[name]
            state = self._queues[name]
            self._expire(state, time.monotonic())
            self._dispatch(state)

    def _expire(self, state: _QueueState, now: float) -> None:
        if state.settings.ttl is None:
            return
        for ready in state.deques():
            # Like RabbitMQ, only the head expires: a message behind it waits its turn.
            while ready and ready[0].expires_at is not None and ready[0].expires_at <= now:
                self._dead_letter(state, ready.popleft().message, EXPIRED)

    def _dispatch(self, state: _QueueState) -> None:
        while state.ready():
            consumer = state.active_consumer()
            if consumer is None:
                return
            entry = state.pop()
            if entry is None:
                return
            consumer.push(entry)

    # -- consumers (lock held) -----------------------------------------------------------------

    def _register(self, consumer: MemoryConsumer) -> None:
        state = self._queues.get(consumer.queue)
        if state is None:
            raise BrokerError(f"queue {consumer.queue!r} does not exist: declare the topology")
        state.consumers.append(consumer)
        self._dirty[state.name] = None
        self._settle()

    def _acked(self, queue: str) -> None:
        """A consumer of `queue` has room again."""
        if queue in self._queues:
            self._dirty[queue] = None
            self._settle()

    def _unregister(self, consumer: MemoryConsumer, entries: list[_Entry]) -> None:
        """Remove a consumer; its unacknowledged `entries` (in delivery order) go back."""
        state = self._queues.get(consumer.queue)
        if state is None:
            return
        if consumer in state.consumers:
            state.consumers.remove(consumer)
        self._return(state, entries)

    def _return(self, state: _QueueState, entries: list[_Entry]) -> None:
        """Put unacknowledged `entries` (in delivery order) back, flagged redelivered."""
        back: list[_Entry] = []
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
        self._dirty[state.name] = None
        self._settle()

    def _delivered(self, queue: str, entry: _Entry) -> WireMessage:
        """The consumer's own copy of an entry's message, with what the queue adds on delivery."""
        headers = copy.deepcopy(dict(entry.message.headers))
        state = self._queues.get(queue)
        if state is not None and state.settings.kind == "quorum" and entry.returns:
            headers[H_DELIVERY_COUNT] = entry.returns
        return replace(entry.message, headers=headers)

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
        while True:
            now = time.monotonic()
            due: float | None = None
            for state in self._queues.values():
                if state.settings.ttl is None:
                    continue
                for ready in state.deques():
                    head = ready[0].expires_at if ready else None
                    if head is None:
                        continue
                    if head <= now:
                        self._dirty[state.name] = None
                    elif due is None or head < due:
                        due = head
            if not self._dirty:
                return due
            self._settle()


# --------------------------------------------------------------------------------------------
# Publisher and consumer
# --------------------------------------------------------------------------------------------


class MemoryPublisher:
    """Publishes into a `MemoryBroker`; every message is confirmed (or returned, or nacked) at once.

    Follows the `Publisher` contract: one outcome per message, RETURNED when no queue is bound,
    NACKED when a queue with ``reject-publish`` is full, SKIPPED for the later messages of an
    ordering key after one failed. A publish to a missing exchange, or of a body larger than
    the broker's `max_message_bytes`, is REFUSED, makes it `broken` with the `refusal`
    (RabbitMQ closes the channel) and SKIPS the rest of the batch; a closed broker makes it
    `broken` and the rest of the batch FAILED.
    """

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._broken = False
        self._refusal: Refusal | None = None

    @property
    def broken(self) -> bool:
        return self._broken or self._broker.closed

    @property
    def refusal(self) -> Refusal | None:
        return self._refusal

    def idle(self) -> None:
        """Nothing to service: there is no connection."""

    def publish_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> list[PublishOutcome]:
        """Publish in order; `timeout` does not matter, since confirms are immediate.

        Raises ConfigurationError for a window below 1, MessageError for a priority outside
        0..255 (the messages before it are published).
        """
        if window < 1:
            raise ConfigurationError("window must be >= 1")
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
                with self._broker._lock:
                    outcome = self._broker._publish(message)
            except _Refused as exc:
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
            if key is not None and outcome not in (
                PublishOutcome.CONFIRMED,
                PublishOutcome.RETURNED,
            ):
                failed_keys.add(key)
        return outcomes

    def close(self) -> None:
        """Later batches are FAILED, like a publisher whose connection is closed."""
        self._broken = True


class MemoryConsumer:
    """Consumes one queue of a `MemoryBroker` with a prefetch window.

    The broker hands it messages as a RabbitMQ server pushes them to a consumer: up to
    `prefetch` unacknowledged at a time, from its first `fetch` on. Delivery tags start at 1.
    Each delivery is a deep copy, so what one consumer does to a message no one else sees.
    """

    def __init__(self, broker: MemoryBroker, queue: str, *, prefetch: int) -> None:
        self._broker = broker
        self.queue = queue
        self._prefetch = prefetch
        self._registered = False
        self._closed = False
        self._next_tag = 1
        self._unacked: dict[int, _Entry] = {}  # delivered, not acknowledged; in tag order
        self._unfetched: deque[int] = deque()  # tags handed over that `fetch` has not returned
        self.arrived = threading.Condition(broker._lock)

    # Called by the broker with its lock held.

    def has_capacity(self) -> bool:
        return self._prefetch == 0 or len(self._unacked) < self._prefetch

    def push(self, entry: _Entry) -> None:
        tag = self._next_tag
        self._next_tag += 1
        self._unacked[tag] = entry
        self._unfetched.append(tag)
        self.arrived.notify_all()

    # The Consumer protocol.

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        """Up to `max_count` deliveries, waiting at most `wait` seconds once one has arrived.

        Blocks up to `wait` seconds for a first delivery and returns [] if none came; then keeps
        collecting until `max_count`, until `wait` seconds after the first, or until the
        prefetch window is full (no more can come before an ack). Raises BrokerError if the
        queue does not exist, BrokerConnectionError if the consumer or the broker is closed.
        """
        if max_count < 1:
            raise ConfigurationError("max_count must be >= 1")
        if wait < 0:
            raise ConfigurationError("wait must be >= 0")
        broker = self._broker
        with broker._lock:
            self._check_usable()
            if not self._registered:
                broker._register(self)
                self._registered = True
            start = time.monotonic()
            first_at = 0.0
            batch: list[Delivery] = []
            while True:
                if self._unfetched:
                    tag = self._unfetched.popleft()
                    entry = self._unacked[tag]
                    batch.append(
                        Delivery(broker._delivered(self.queue, entry), tag, entry.redelivered)
                    )
                    now = time.monotonic()
                    if len(batch) == 1:
                        first_at = now
                    if len(batch) >= max_count or now - first_at >= wait:
                        break
                    continue
                if batch and not self.has_capacity():
                    break
                remaining = (first_at if batch else start) + wait - time.monotonic()
                if remaining <= 0:
                    break
                self.arrived.wait(remaining)
                self._check_usable()
            return batch

    def ack_through(self, tag: int) -> None:
        """Acknowledge every delivery up to and including `tag` (0: all of them).

        An unknown tag closes the consumer, its deliveries requeued, and raises
        BrokerConnectionError: RabbitMQ closes the channel (PRECONDITION_FAILED).
        """
        with self._broker._lock:
            self._check_usable()
            if tag != 0 and tag not in self._unacked:
                self._channel_error(f"unknown delivery tag {tag}")
            self._settle_tags([t for t in self._unacked if tag == 0 or t <= tag])

    def ack(self, tag: int) -> None:
        """Acknowledge one delivery; an unknown tag is handled as by `ack_through`."""
        with self._broker._lock:
            self._check_usable()
            if tag not in self._unacked:
                self._channel_error(f"unknown delivery tag {tag}")
            self._settle_tags([tag])

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        """Republish `delivery` to `exchange` with `headers` added, then acknowledge it.

        The original exchange and routing key are kept in ``x-original-exchange`` and
        ``x-original-routing-key`` (unless already there). Raises BrokerError if no queue is
        bound for the target or a full queue refuses it, BrokerConnectionError if the exchange
        does not exist (RabbitMQ closes the channel) or the broker is closed; the delivery is
        then not acknowledged.
        """
        broker = self._broker
        with broker._lock:
            self._check_usable()
            if delivery.tag not in self._unacked:
                self._channel_error(f"unknown delivery tag {delivery.tag}")
            message = delivery.message
            merged = dict(message.headers)
            merged.setdefault(H_ORIGINAL_EXCHANGE, message.exchange)
            merged.setdefault(H_ORIGINAL_ROUTING_KEY, message.routing_key)
            merged.update(headers)
            outgoing = replace(
                message, exchange=exchange, routing_key=routing_key, headers=merged, key=None
            )
            try:
                outcome = broker._publish(outgoing)
            except _Refused as exc:
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
            self._settle_tags([delivery.tag])

    def close(self) -> None:
        """Stop consuming; unacknowledged deliveries go back to the queue. Never raises.

        They return to their place in the queue (the front, for a single consumer), in order,
        flagged redelivered; a quorum queue counts the return and dead-letters a message past
        its ``x-delivery-limit``.
        """
        with self._broker._lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    # Internals, lock held.

    def _check_usable(self) -> None:
        if self._broker.closed:
            raise BrokerConnectionError(
                f"the in-memory broker {self._broker.description} is closed"
            )
        if self._closed:
            raise BrokerConnectionError(f"the consumer of {self.queue!r} is closed")

    def _settle_tags(self, tags: list[int]) -> None:
        for tag in tags:
            del self._unacked[tag]
        if self._unfetched:
            self._unfetched = deque(t for t in self._unfetched if t in self._unacked)
        self._broker._acked(self.queue)

    def _release(self) -> None:
        entries = [self._unacked[tag] for tag in sorted(self._unacked)]
        self._unacked.clear()
        self._unfetched.clear()
        if self._registered and not self._broker.closed:
            self._broker._unregister(self, entries)
        self.arrived.notify_all()

    def _channel_error(self, reason: str) -> None:
        self._closed = True
        self._release()
        raise BrokerConnectionError(
            f"{reason} on the consumer of {self.queue!r}: the channel is closed, its deliveries "
            "requeued (RabbitMQ: PRECONDITION_FAILED)"
        )


# --------------------------------------------------------------------------------------------
# The operator session
# --------------------------------------------------------------------------------------------


class MemoryOperator:
    """An operator session on a `MemoryBroker` (the `Operator` protocol).

    Checks judge as a redeclare does; a reader takes messages like ``basic.get`` without ack;
    a tail consumes a private queue the session deletes when it closes. The memory broker
    never blocks publishers, so `flow_control` is always None.
    """

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker
        self._readers: list[MemoryQueueReader] = []
        self._tail_queues: list[str] = []

    def __enter__(self) -> MemoryOperator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def description(self) -> str:
        return self._broker.description

    def flow_control(self, timeout: float = 1.0) -> str | None:
        """None: nothing blocks publishers in memory. Raises BrokerConnectionError if closed."""
        with self._broker._lock:
            self._broker._check_open()
        return None

    def check_exchange(self, exchange: Exchange) -> Found:
        """Whether `exchange` exists as declared, judged as a redeclare is."""
        with self._broker._lock:
            self._broker._check_open()
            existing = self._broker._exchanges.get(exchange.name)
            if existing is None:
                return Found(MISSING)
            difference = _exchange_difference(existing, exchange)
        return Found(DIFFERS, difference) if difference else Found(PRESENT)

    def check_queue(self, queue: Queue) -> Found:
        """Whether `queue` exists as declared, judged as a redeclare is."""
        with self._broker._lock:
            self._broker._check_open()
            existing = self._broker._queues.get(queue.name)
            if existing is None:
                return Found(MISSING)
            try:
                _queue_settings(queue)
            except TopologyMismatch as exc:  # RabbitMQ answers an invalid argument with 406 too
                return Found(DIFFERS, str(exc))
            difference = _queue_difference(existing.spec, queue, existing.settings.kind)
        return Found(DIFFERS, difference) if difference else Found(PRESENT)

    def queue_info(self, name: str) -> tuple[int, int] | None:
        """(ready messages, consumers) of queue `name`, or None if it does not exist."""
        with self._broker._lock:
            ready = self._broker.queue_depth(name)
            state = self._broker._queues.get(name)
            return None if ready is None or state is None else (ready, len(state.consumers))

    def purge_queue(self, name: str) -> int:
        """Drop every ready message of queue `name`; return how many (0 if it is missing)."""
        with self._broker._lock:
            self._broker._check_open()
            state = self._broker._queues.get(name)
            if state is None:
                return 0
            count = state.ready()
            for ready in state.deques():
                ready.clear()
            return count

    def delete_queue(self, name: str) -> int:
        """Delete queue `name`, its bindings and messages; return how many were ready."""
        broker = self._broker
        with broker._lock:
            broker._check_open()
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
        """A reader of `queue`. Raises BrokerError if it is missing."""
        with self._broker._lock:
            self._broker._check_open()
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
        """Copy messages routed by `exchange` with any of `patterns` to `on_message`.

        The copies go through a private queue, deleted when this session closes. Raises
        BrokerError if `exchange` does not exist.
        """
        broker = self._broker
        name = f"amq.gen-{uuid.uuid4().hex}"
        with broker._lock:
            broker._check_open()
            if exchange not in broker._exchanges:
                raise BrokerError(f"cannot bind a tail queue: no exchange {exchange!r}")
            broker._queues[name] = _QueueState(Queue(name, durable=False), _QueueSettings())
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


class MemoryQueueReader:
    """Takes messages from one queue of a `MemoryBroker` without acknowledging them (the
    `QueueReader` protocol). A republish is a mandatory, confirmed publish through the
    broker's exchanges; `QueuedMessage.properties` is unused (the message carries them)."""

    def __init__(self, broker: MemoryBroker, queue: str) -> None:
        self._broker = broker
        self._queue = queue
        self._taken: dict[int, _Entry] = {}
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
        """The next ready message, unacknowledged; None when the queue has no more."""
        broker = self._broker
        with broker._lock:
            self.depth()  # expires what is due, raises if the queue is gone
            entry = broker._queues[self._queue].pop()
            if entry is None:
                return None
            tag = next(self._tags)
            self._taken[tag] = entry
            return QueuedMessage(tag, broker._delivered(self._queue, entry), entry.redelivered)

    def ack(self, message: QueuedMessage) -> None:
        """Remove `message` from the queue for good. Raises BrokerError for an unknown one."""
        with self._broker._lock:
            if self._taken.pop(message.tag, None) is None:
                raise BrokerError(f"unknown delivery tag {message.tag} on {self._queue!r}")

    def republish(
        self, message: QueuedMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> bool:
        """Publish a copy of `message` with these `headers`, mandatory and confirmed.

        False when no queue is bound for it; raises BrokerError when the exchange is missing
        or a full queue refuses it. The original is not acknowledged here.
        """
        copied = replace(
            message.message, exchange=exchange, routing_key=routing_key, headers=dict(headers)
        )
        with self._broker._lock:
            try:
                outcome = self._broker._publish(copied)
            except _Refused as exc:
                raise BrokerError(f"republishing to {exchange or '(default)'!r}: {exc}") from exc
        if outcome is PublishOutcome.NACKED:
            raise BrokerError(f"the broker refused the copy sent to {exchange!r}")
        return outcome is PublishOutcome.CONFIRMED

    def close(self) -> None:
        """Every message taken and not acknowledged returns to its place, redelivered."""
        broker = self._broker
        with broker._lock:
            entries = [self._taken[tag] for tag in sorted(self._taken)]
            self._taken.clear()
            state = broker._queues.get(self._queue)
            if entries and state is not None and not broker.closed:
                broker._return(state, entries)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _same(before: Any, now: Any) -> bool:
    """Equal as AMQP values: ``True`` and ``1`` differ, as they do to RabbitMQ."""
    return isinstance(before, bool) == isinstance(now, bool) and before == now


def _frozen_exchange(spec: Exchange) -> Exchange:
    return replace(spec, arguments=copy.deepcopy(dict(spec.arguments)))


def _frozen_queue(spec: Queue) -> Queue:
    return replace(spec, arguments=copy.deepcopy(dict(spec.arguments)))


def _queue_settings(queue: Queue) -> _QueueSettings:
    """Validate a queue's arguments as RabbitMQ 3.10 does; raise TopologyMismatch if invalid."""
    args = queue.arguments
    kind = _text_argument(queue, "x-queue-type") or "classic"
    if kind == "stream":
        raise BrokerError(f"queue {queue.name!r}: stream queues are not supported in memory")
    if kind not in ("classic", "quorum"):
        raise _invalid(queue, "x-queue-type", f"unsupported queue type {kind!r}")
    ttl = _integer_argument(queue, "x-message-ttl", 0)
    _integer_argument(queue, "x-expires", 1)
    dead_letter_exchange = _text_argument(queue, "x-dead-letter-exchange")
    dead_letter_routing_key = _text_argument(queue, "x-dead-letter-routing-key")
    if dead_letter_routing_key is not None and dead_letter_exchange is None:
        raise _invalid(
            queue, "x-dead-letter-routing-key", "routing key but no dead-letter exchange"
        )
    max_length = _integer_argument(queue, "x-max-length", 0)
    overflow = _text_argument(queue, "x-overflow") or "drop-head"
    if overflow not in OVERFLOW_MODES:
        raise _invalid(queue, "x-overflow", f"invalid overflow mode {overflow!r}")
    max_priority = _integer_argument(queue, "x-max-priority", 0, 255)
    single = args.get("x-single-active-consumer", False)
    if not isinstance(single, bool):
        raise _invalid(queue, "x-single-active-consumer", f"expected a boolean, got {single!r}")
    delivery_limit = _quorum_delivery_limit(queue) if kind == "quorum" else None
    return _QueueSettings(
        kind=kind,
        ttl=ttl / 1000 if ttl is not None else None,
        dead_letter_exchange=dead_letter_exchange,
        dead_letter_routing_key=dead_letter_routing_key,
        max_length=max_length,
        overflow=overflow,
        max_priority=max_priority,
        single_active_consumer=single,
        delivery_limit=delivery_limit,
    )


def _quorum_delivery_limit(queue: Queue) -> int | None:
    """Check what a quorum queue refuses; return its delivery limit (None: no limit)."""
    if not queue.durable:
        raise TopologyMismatch(f"queue {queue.name!r}: a quorum queue must be durable")
    for name in ("x-max-priority", "x-queue-mode"):
        if name in queue.arguments:
            raise _invalid(queue, name, "not supported by quorum queues")
    return _integer_argument(queue, "x-delivery-limit", -(2**31))


def _invalid(queue: Queue, name: str, why: str) -> TopologyMismatch:
    return TopologyMismatch(f"invalid argument {name!r} for queue {queue.name!r}: {why}")


def _integer_argument(
    queue: Queue, name: str, minimum: int, maximum: int | None = None
) -> int | None:
    """The integer argument `name` of `queue`, None when absent; TopologyMismatch when it is
    not an integer in [minimum, maximum]."""
    if name not in queue.arguments:
        return None
    value = queue.arguments[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(queue, name, f"expected an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise _invalid(queue, name, f"{value} is out of range")
    return value


def _text_argument(queue: Queue, name: str) -> str | None:
    """The string argument `name` of `queue`, None when absent; TopologyMismatch when it is
    not a string."""
    if name not in queue.arguments:
        return None
    value = queue.arguments[name]
    if not isinstance(value, str):
        raise _invalid(queue, name, f"expected a string, got {value!r}")
    return value


def _exchange_difference(existing: _ExchangeState, spec: Exchange) -> str | None:
    """How `spec` differs from the declared exchange where RabbitMQ looks (type, durability
    and, among the arguments, only the alternate), or None."""
    alternate = spec.arguments.get("alternate-exchange")
    for prop, before, now in (
        ("type", existing.spec.type, spec.type),
        ("durable", existing.spec.durable, spec.durable),
        ("alternate-exchange", existing.alternate, alternate),
    ):
        if not _same(before, now):
            return (
                f"exchange {spec.name!r} exists with other arguments: {prop} is {before!r}, "
                f"declared now as {now!r}"
            )
    return None


def _queue_difference(old: Queue, new: Queue, kind: str) -> str | None:
    """How `new` differs from the declared `old` where RabbitMQ looks, or None."""
    what = f"queue {old.name!r} exists with other arguments"
    if old.durable != new.durable:
        return f"{what}: durable is {old.durable}, declared now as {new.durable}"
    names = QUORUM_EQUIVALENCE_ARGUMENTS if kind == "quorum" else EQUIVALENCE_ARGUMENTS
    for name in names:
        before, now = old.arguments.get(name), new.arguments.get(name)
        if name == "x-queue-type":  # no type means classic
            before, now = before or "classic", now or "classic"
        if not _same(before, now):
            return f"{what}: {name} is {before!r}, declared now as {now!r}"
    return None


def _private_copy(message: WireMessage) -> WireMessage:
    """The broker's own copy: nobody holding the original can change what consumers see.

    The ordering key is the publisher's business and does not travel, as on AMQP.
    """
    return replace(
        message, body=bytes(message.body), headers=copy.deepcopy(dict(message.headers)), key=None
    )


def _with_death(
    headers: Mapping[str, Any], reason: str, queue: str, exchange: str, routing_key: str
) -> dict[str, Any]:
    """`headers` with the ``x-death`` record RabbitMQ 3.10 writes when it dead-letters.

    A death in the same queue for the same reason counts up its entry and moves it first;
    ``x-first-death-*`` are written with the first record only.
    """
    out = copy.deepcopy(dict(headers))
    deaths = out.get("x-death")
    if isinstance(deaths, list):
        for index, death in enumerate(deaths):
            if (
                isinstance(death, Mapping)
                and death.get("queue") == queue
                and death.get("reason") == reason
            ):
                counted = dict(death)
                counted["count"] = int(counted.get("count", 0)) + 1
                out["x-death"] = [counted, *deaths[:index], *deaths[index + 1 :]]
                return out
    event = {
        "count": 1,
        "reason": reason,
        "queue": queue,
        "time": datetime.now(UTC).replace(microsecond=0),
        "exchange": exchange,
        "routing-keys": [routing_key],
    }
    if isinstance(deaths, list):
        out["x-death"] = [event, *deaths]
    else:
        out["x-first-death-reason"] = reason
        out["x-first-death-queue"] = queue
        out["x-first-death-exchange"] = exchange
        out["x-death"] = [event]
    return out


def _is_cycle(queue: str, deaths: list[Any]) -> bool:
    """RabbitMQ's rule: drop a dead letter that would return to a queue it already died in,
    unless a consumer rejected it somewhere on the way (a cycle with no one deciding)."""
    path: list[Any] = []
    for death in deaths:
        path.append(death)
        if isinstance(death, Mapping) and death.get("queue") == queue:
            return all(isinstance(d, Mapping) and d.get("reason") != "rejected" for d in path)
    return False
