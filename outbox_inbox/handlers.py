"""The handler registry: which function handles which command or event."""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypedDict, Unpack, get_args

from opentelemetry.trace import Span, Tracer
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable
from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

from .claim_check import resolve
from .config import Settings
from .context import handling
from .errors import ConfigurationError, HandlerExited
from .faults import FAULT, is_fault, log_unhandled_fault
from .listener import Listener, call
from .messages import COMMAND, EVENT, Message
from .outbox import Outbox, WriteKeywords
from .payloads import declared_payload_type, decode
from .retry import RetryPolicy
from .topology import topic_matches
from .tracing import current, processing, processing_batch

Handler = Callable[[Message, Session], Any]
#: A coroutine function handler: ``async def handler(message, session: AsyncSession)``.
AsyncHandler = Callable[[Message, AsyncSession], Awaitable[Any]]


def is_async_handler(handler: Callable[..., Any]) -> bool:
    """True for an ``async def`` handler (or a partial of one, or an object whose ``__call__``
    is one): it gets an AsyncSession and runs only in the asyncio worker (`aio.AsyncWorker`)."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - the callable object's own method
    )


@dataclass(frozen=True)
class HandlerContext:
    """What a handler written as ``def handler(ctx: HandlerContext)`` gets: `session`, the Session
    of the transaction that marks the message processed (do not commit it); `payload`, decoded into
    the handler's declared type when it has one (outbox_inbox.payloads); `publish` and `send`, which
    write to the outbox in that session with the message's ids as causation and correlation."""

    message: Message
    session: Session
    payload: Any
    outbox: Outbox
    #: The message's ``process`` span where it is not the current one (in a batch handler).
    span: Span | None = None

    def publish(self, event: str, payload: Any, **options: Unpack[WriteKeywords]) -> uuid.UUID:
        """`Outbox.publish` in this handler's transaction."""
        # The message's ids and span, in a batch handler too.
        with handling(self.message), current(self.span):
            return self.outbox.publish(self.session, event, payload, **options)

    def send(
        self, *, to: str, command: str, payload: Any, **options: Unpack[WriteKeywords]
    ) -> uuid.UUID:
        """`Outbox.send` in this handler's transaction (keywords only, never swapped by mistake)."""
        with handling(self.message), current(self.span):
            return self.outbox.send(self.session, to, command, payload, **options)

    def write(self, statement: Executable, parameters: Mapping[str, Any]) -> None:
        """Execute `statement` with `parameters` later in this handler's transaction: at the
        end of the batch, after the session's flush, in one executemany with every other write
        of the same statement object. A write that fails fails the batch (docs/concepts.md,
        "A deferred write")."""
        defer_write(self.session, statement, parameters)


@dataclass(frozen=True)
class AsyncHandlerContext:
    """What an ``async def handler(ctx: AsyncHandlerContext)`` gets: `HandlerContext` with an
    `AsyncSession` and awaited `publish` / `send`."""

    message: Message
    session: AsyncSession
    payload: Any
    outbox: Outbox
    span: Span | None = None

    async def publish(
        self, event: str, payload: Any, **options: Unpack[WriteKeywords]
    ) -> uuid.UUID:
        """`Outbox.publish_async` in this handler's transaction."""
        with handling(self.message), current(self.span):
            return await self.outbox.publish_async(self.session, event, payload, **options)

    async def send(
        self, *, to: str, command: str, payload: Any, **options: Unpack[WriteKeywords]
    ) -> uuid.UUID:
        """`Outbox.send_async` in this handler's transaction (keywords only)."""
        with handling(self.message), current(self.span):
            return await self.outbox.send_async(self.session, to, command, payload, **options)

    def write(self, statement: Executable, parameters: Mapping[str, Any]) -> None:
        """`HandlerContext.write`: run at the end of the batch (nothing to await here)."""
        defer_write(self.session.sync_session, statement, parameters)


@dataclass(frozen=True)
class BatchContext:
    """What a batch handler written as ``def handler(batch: BatchContext)`` gets: `messages` and
    `payloads` in claim order (each payload decoded into the handler's declared type when it has
    one), and `session`, that of the transaction that marks them all processed. Iterating gives
    one `HandlerContext` per message, whose `publish` / `send` carry its ids."""

    messages: Sequence[Message]
    payloads: Sequence[Any]
    session: Session
    outbox: Outbox
    #: The messages' ``process`` spans, in the same order (empty when tracing is off).
    spans: Sequence[Span] = ()

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[HandlerContext]:
        for n, (message, payload) in enumerate(zip(self.messages, self.payloads, strict=True)):
            span = self.spans[n] if self.spans else None
            yield HandlerContext(message, self.session, payload, self.outbox, span)


@dataclass(frozen=True)
class AsyncBatchContext:
    """`BatchContext` for an ``async def`` batch handler: an `AsyncSession`, and one
    `AsyncHandlerContext` per message when iterated."""

    messages: Sequence[Message]
    payloads: Sequence[Any]
    session: AsyncSession
    outbox: Outbox
    spans: Sequence[Span] = ()

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[AsyncHandlerContext]:
        for n, (message, payload) in enumerate(zip(self.messages, self.payloads, strict=True)):
            span = self.spans[n] if self.spans else None
            yield AsyncHandlerContext(message, self.session, payload, self.outbox, span)


#: Where a Session keeps the writes of `defer_write` (in `Session.info`, the user's dict).
_WRITES = "outbox_inbox.writes"
#: What a handler may raise that is not an `Exception` and is still its failure, not the
#: worker's end (asyncio.CancelledError is not among them: it is how an asyncio worker stops).
_EXITS = (SystemExit, KeyboardInterrupt, GeneratorExit)


def defer_write(session: Session, statement: Executable, parameters: Mapping[str, Any]) -> None:
    """Add a write that `run_writes` executes later in `session` (see `HandlerContext.write`)."""
    writes: dict[int, tuple[Executable, list[Mapping[str, Any]]]]
    writes = session.info.setdefault(_WRITES, {})
    writes.setdefault(id(statement), (statement, []))[1].append(parameters)


def run_writes(session: Session) -> None:
    """Execute the writes deferred in `session`, one executemany per statement, in the order
    each statement was first written; then forget them. Raises what the database raises."""
    writes = session.info.pop(_WRITES, None)
    if writes:
        for statement, parameters in writes.values():
            session.execute(statement, parameters)


_CONTEXTS = (HandlerContext, AsyncHandlerContext, BatchContext, AsyncBatchContext)
_CONTEXT_NAMES = tuple(c.__name__ for c in _CONTEXTS)


def _takes_context(handler: Callable[..., Any], batch: bool) -> bool:
    """True when a handler's first parameter is a context (annotated so, or named ``ctx``,
    ``context``, or ``batch`` for a batch handler)."""
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if not parameters:
        return False
    first = parameters[0]
    annotation = first.annotation
    if isinstance(annotation, str):
        return annotation.split(".")[-1] in _CONTEXT_NAMES
    names = ("ctx", "context", "batch") if batch else ("ctx", "context")
    return annotation in _CONTEXTS or (
        annotation is inspect.Parameter.empty and first.name in names
    )


#: `HandlerOptions.delivery` (docs/configuration.md, "Handler options").
Delivery = Literal["exactly_once", "at_most_once", "one_attempt"]
#: The retry policy of ``one_attempt``: the first failure is final (`retry.MAX_ATTEMPTS`).
_ONCE = RetryPolicy(max_attempts=1)


class HandlerKeywords(TypedDict, total=False):
    """The keywords of `Service.on_command` and `on_event`: the fields of `HandlerOptions`
    (for type checkers; tests/unit/test_handler_options.py holds the two equal)."""

    retry: RetryPolicy | None
    batch: bool
    version: int | None
    max_concurrency: int | None
    rate: tuple[int, float] | None
    weight: int | None
    delivery: Delivery


@dataclass(frozen=True, kw_only=True)
class HandlerOptions:
    """How one handler is run: the options of docs/configuration.md ("Handler options"), validated
    once (ConfigurationError); None is the service's policy, every version, no cap or weight 1."""

    retry: RetryPolicy | None = None
    batch: bool = False
    version: int | None = None
    max_concurrency: int | None = None
    rate: tuple[int, float] | None = None
    weight: int | None = None
    delivery: Delivery = "exactly_once"

    def __post_init__(self) -> None:
        if self.delivery not in get_args(Delivery):
            raise ConfigurationError(f"delivery must be one of {get_args(Delivery)}")
        if self.delivery != "exactly_once" and self.retry is not None:
            raise ConfigurationError(f"delivery={self.delivery!r} is one attempt: no retry policy")
        for name in ("version", "max_concurrency", "weight"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")
        r = self.rate  # (n, seconds); type() refuses a bool for either
        ok = type(r) is tuple and len(r) == 2 and type(r[0]) is int and type(r[1]) in (int, float)
        if r is not None and not (ok and r[0] >= 1 and r[1] > 0):
            raise ConfigurationError(f"rate must be (int n >= 1, seconds > 0), got {r!r}")


@dataclass(frozen=True)
class Subscription:
    """A handler and what it handles: `kind` ``command``, ``event`` or ``fault`` (`on_fault`),
    `pattern` a full routing key or topic pattern. How it is called (message and session, a
    context, a typed payload, a batch): docs/concepts.md ("Writing handlers", "Handlers run in
    batches"). `outbox` is the service's, for the context's publish and send."""

    kind: str
    pattern: str
    handler: Handler | AsyncHandler
    outbox: Outbox | None = None
    options: HandlerOptions = HandlerOptions()
    payload_type: type | None = field(init=False, default=None)
    takes_context: bool = field(init=False, default=False)
    #: An ``async def`` handler (read once: the worker asks for every message).
    is_async: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        batch = self.options.batch
        object.__setattr__(self, "payload_type", declared_payload_type(self.handler, batch=batch))
        object.__setattr__(self, "takes_context", _takes_context(self.handler, batch))
        object.__setattr__(self, "is_async", is_async_handler(self.handler))
        if self.takes_context and self.outbox is None:
            raise ConfigurationError(
                f"handler {self.name} takes a context: register it with the service's "
                "on_command / on_event, which give the context its outbox"
            )

    @property
    def name(self) -> str:
        return getattr(self.handler, "__qualname__", repr(self.handler))

    @property
    def _outbox(self) -> Outbox:
        assert self.outbox is not None  # a handler that takes a context has one: __post_init__
        return self.outbox

    def handles(self, version: int) -> bool:
        """True when this subscription handles payload `version`."""
        return self.options.version in (None, version)

    def call(self, message: Message, session: Session) -> Any:
        """Run the handler with `session`, the worker's Session in the marking transaction (a batch
        handler: a batch of this one message). An async handler gets an `AsyncSession` over that
        Session, awaited in the asyncio worker's greenlet (docs/async-services.md); outside that
        worker it raises `ConfigurationError`, which the worker records as a handler failure."""
        if self.options.batch:
            return self.call_batch([message], session)
        payload = message.payload
        if self.payload_type is not None:
            payload = decode(payload, self.payload_type)  # InvalidPayload: dead at once
        typed = {"payload": payload} if self.payload_type is not None else {}
        kind = AsyncHandlerContext if self.is_async else HandlerContext
        context = lambda s: kind(message, s, payload, self._outbox)  # noqa: E731
        return self._invoke(message, session, context, typed)

    def call_batch(
        self, messages: Sequence[Message], session: Session, spans: Sequence[Span] = ()
    ) -> Any:
        """Run a batch handler once for `messages` (see `call` for the session), whose
        ``process`` spans are `spans`. Raises InvalidPayload when a payload does not fit the
        declared type: the worker then runs the messages one at a time."""
        payloads = [m.payload for m in messages]
        if self.payload_type is not None:
            payloads = [decode(p, self.payload_type) for p in payloads]
        typed = {"payloads": payloads} if self.payload_type is not None else {}
        kind = AsyncBatchContext if self.is_async else BatchContext
        context = lambda s: kind(messages, payloads, s, self._outbox, spans)  # noqa: E731
        return self._invoke(list(messages), session, context, typed)

    def _invoke(
        self, first: Any, session: Session, context: Callable[[Any], Any], typed: dict[str, Any]
    ) -> Any:
        """Call the handler with `first` (the message, or the list of a batch) and the session,
        or with `context` of the session when it takes one; async: with an `AsyncSession`
        over it, awaited in the worker's greenlet. An exit it raises is `HandlerExited`."""
        given: Any = self._async_session(session) if self.is_async else session
        args = (context(given),) if self.takes_context else (first, given)
        try:
            result = self.handler(*args, **typed)
            return await_only(result) if self.is_async else result
        except _EXITS as exc:
            raise HandlerExited(self.name, exc) from exc

    def _async_session(self, session: Session) -> AsyncSession:
        if not in_greenlet():
            raise ConfigurationError(
                f"async handler {self.name} runs only in the asyncio worker: run the service"
                " with start(), run(), run_worker() or run_async(), which choose it"
            )
        return AsyncSession(sync_session_class=lambda **_: session)  # type: ignore[arg-type]


class Found(NamedTuple):
    """`Handlers.find`'s answer: every subscription, those called per message, the batch
    handlers, and their `delivery` (``one_attempt`` where their options differ: never run twice,
    never lost without a dead letter)."""

    every: list[Subscription]
    single: list[Subscription]
    batch: list[Subscription]
    delivery: Delivery = "exactly_once"

    @property
    def retry(self) -> RetryPolicy | None:
        """``one_attempt``'s policy, else the first handler's own one (None: the service's)."""
        if self.delivery == "one_attempt":
            return _ONCE
        return next((s.options.retry for s in self.every if s.options.retry is not None), None)


@dataclass(frozen=True)
class Calls:
    """How the worker calls handlers: each message in its ``process`` span (`tracer`, of
    `service`), the listener told how long its handlers ran (`Listener.handler_ran`)."""

    settings: Settings
    service: str
    tracer: Tracer | None
    listener: Listener | None

    def each(self, message: Message, subscriptions: list[Subscription], session: Session) -> None:
        """Run `subscriptions` for `message` (a batch handler with a batch of it alone), as
        the current message. Raises what a handler raises."""
        started = time.perf_counter()
        try:
            message = self.resolve(message)
            with handling(message), processing(self.tracer, self.service, message):
                for subscription in subscriptions:
                    subscription.call(message, session)
        except Exception as exc:
            self._ran(message, time.perf_counter() - started, exc)
            raise
        self._ran(message, time.perf_counter() - started, None)

    def batch(self, subscription: Subscription, messages: list[Message], session: Session) -> None:
        """Run a batch handler once for `messages`; the listener gets each message's share of
        the time it ran. Raises what it raises."""
        started = time.perf_counter()
        messages = [self.resolve(m) for m in messages]
        with processing_batch(self.tracer, self.service, messages) as spans:
            subscription.call_batch(messages, session, spans)
        share = (time.perf_counter() - started) / len(messages)
        for message in messages:
            self._ran(message, share, None)

    def resolve(self, message: Message) -> Message:
        """`message` with the payload its reference names (`claim_check.resolve`)."""
        return resolve(message, (self.settings.payload_store, *self.settings.payload_sources))

    def _ran(self, message: Message, seconds: float, error: Exception | None) -> None:
        if self.listener is not None:
            call(self.listener, "handler_ran", message, seconds, error)


class Handlers:
    """Subscriptions of one service. Register before `start()`; lookups are thread-safe."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        # find()'s answers, asked for every message; cleared whenever a handler is added.
        self._found: dict[tuple[str, str, int], Found] = {}

    def add(self, subscription: Subscription) -> None:
        if not callable(subscription.handler):
            raise ConfigurationError(f"handler for {subscription.pattern!r} is not callable")
        version = subscription.options.version
        for existing in self._subscriptions:
            other = existing.options.version
            if (
                existing.kind == COMMAND == subscription.kind
                and existing.pattern == subscription.pattern
                and (other is None or version is None or other == version)
            ):
                which = "" if version is None else f" version {version}"
                raise ConfigurationError(
                    f"command {subscription.pattern!r}{which} already has a handler"
                )
        wildcard = {"*", "#"} & set(subscription.pattern.split("."))
        for name in ("max_concurrency", "rate", "weight"):
            if wildcard and getattr(subscription.options, name) is not None:
                raise ConfigurationError(
                    f"{name} applies to one routing key; {subscription.pattern!r} is a pattern"
                )
        self._subscriptions.append(subscription)
        self._found = {}

    def per_key(self, option: str) -> dict[str, Any]:
        """The `HandlerOptions` `option` (``max_concurrency``, ``rate``, ``weight``) of each
        routing key that has one. Where several handlers of the key have one, the smallest; of
        rates, the fewest n over the longest period, which keeps to each handler's rate."""
        found: dict[str, Any] = {}
        for s in self._subscriptions:
            n = getattr(s.options, option)
            if n is not None:
                was = found.get(s.pattern, n)
                rate = option == "rate"
                found[s.pattern] = (min(n[0], was[0]), max(n[1], was[1])) if rate else min(n, was)
        return found

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return tuple(self._subscriptions)

    @property
    def any_async(self) -> bool:
        """True when a handler is ``async def``: the service's workers are asyncio workers."""
        return any(s.is_async for s in self._subscriptions)

    def event_patterns(self) -> list[str]:
        return [s.pattern for s in self._subscriptions if s.kind == EVENT]

    def find(self, kind: str, routing_key: str, version: int = 1) -> Found:
        """Every subscription of `kind` matching `routing_key` and handling payload `version`
        (its own, or every version), in registration order, and those split into handlers
        called per message and batch handlers. The lists are shared: do not change them."""
        found = self._found.get((kind, routing_key, version))
        if found is None:
            if kind == COMMAND:
                every = [
                    s
                    for s in self._subscriptions
                    if (s.kind == COMMAND and s.pattern == routing_key)
                    or (s.kind == FAULT and topic_matches(s.pattern, routing_key))
                ]
                if not every and is_fault(routing_key):
                    every = [_UNHANDLED_FAULT]  # logged and processed, not dead
            else:
                every = [
                    s
                    for s in self._subscriptions
                    if s.kind == EVENT and topic_matches(s.pattern, routing_key)
                ]
            every = [s for s in every if s.handles(version)]
            modes: set[Delivery] = {s.options.delivery for s in every} or {"exactly_once"}
            found = Found(
                every,
                [s for s in every if not s.options.batch],
                [s for s in every if s.options.batch],
                modes.pop() if len(modes) == 1 else "one_attempt",
            )
            if len(self._found) < 10_000:  # routing keys come from senders: keep it bounded
                self._found[(kind, routing_key, version)] = found
        return found

    def advertised(self) -> list[dict[str, Any]]:
        """What this service handles, as the instances table stores it: one ``{"kind",
        "pattern", "versions"}`` per kind and pattern (``versions`` sorted, or None: every
        version), with ``cap`` (``max_concurrency``) and ``rate`` where it has them."""
        versions: dict[tuple[str, str], set[int] | None] = {}
        for s in self._subscriptions:
            key = (s.kind, s.pattern)
            known = versions.setdefault(key, set())
            if s.options.version is None or known is None:
                versions[key] = None
            else:
                known.add(s.options.version)
        caps = {"cap": self.per_key("max_concurrency"), "rate": self.per_key("rate")}
        return [
            {"kind": k, "pattern": p, "versions": None if v is None else sorted(v)}
            | {name: cap[p] for name, cap in caps.items() if p in cap}
            for (k, p), v in versions.items()
        ]


def handled_by(advertised: Sequence[Mapping[str, Any]], kind: str, key: str, version: int) -> bool:
    """True when handlers as `Handlers.advertised` lists them take a message of `kind`
    (command or event), routing key `key` and payload `version`."""
    for h in advertised:
        pattern, versions = str(h.get("pattern")), h.get("versions")
        if h.get("kind") != kind or (versions is not None and version not in versions):
            continue
        if (pattern == key) if kind == COMMAND else topic_matches(pattern, key):
            return True
    return False


#: What handles a fault no `Service.on_fault` handler matches: an INFO line.
_UNHANDLED_FAULT = Subscription(FAULT, "#", log_unhandled_fault)
