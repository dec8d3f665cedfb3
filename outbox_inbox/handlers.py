"""The handler registry: which function handles which command or event."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

from .errors import ConfigurationError
from .messages import COMMAND, EVENT, Message
from .payloads import declared_payload_type, decode
from .retry import RetryPolicy
from .topology import topic_matches

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
    """What a handler written as ``def handler(ctx: HandlerContext)`` gets.

    `session` is the Session of the transaction that marks the message processed (do not
    commit it); `payload` is the message's payload, decoded into the handler's declared type
    when it has one (outbox_inbox.payloads). `publish` and `send` write to the service's
    outbox in that session, with the message's ids as causation and correlation.
    """

    message: Message
    session: Session
    payload: Any
    outbox: Any  # the service's Outbox

    def publish(self, event: str, payload: Any, **options: Any) -> uuid.UUID:
        """`Outbox.publish` in this handler's transaction."""
        message_id: uuid.UUID = self.outbox.publish(self.session, event, payload, **options)
        return message_id

    def send(self, *, to: str, command: str, payload: Any, **options: Any) -> uuid.UUID:
        """`Outbox.send` in this handler's transaction; keywords only, so that the service
        and the command cannot be swapped."""
        message_id: uuid.UUID = self.outbox.send(self.session, to, command, payload, **options)
        return message_id


@dataclass(frozen=True)
class AsyncHandlerContext:
    """What an ``async def handler(ctx: AsyncHandlerContext)`` gets: `HandlerContext` with an
    `AsyncSession` and awaited `publish` / `send`."""

    message: Message
    session: AsyncSession
    payload: Any
    outbox: Any

    async def publish(self, event: str, payload: Any, **options: Any) -> uuid.UUID:
        """`Outbox.publish_async` in this handler's transaction."""
        message_id: uuid.UUID = await self.outbox.publish_async(
            self.session, event, payload, **options
        )
        return message_id

    async def send(self, *, to: str, command: str, payload: Any, **options: Any) -> uuid.UUID:
        """`Outbox.send_async` in this handler's transaction (keywords only)."""
        message_id: uuid.UUID = await self.outbox.send_async(
            self.session, to, command, payload, **options
        )
        return message_id


def _takes_context(handler: Callable[..., Any]) -> bool:
    """True when a handler's first parameter is a context (annotated so, or named ``ctx``)."""
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if not parameters:
        return False
    first = parameters[0]
    annotation = first.annotation
    if isinstance(annotation, str):
        return annotation.split(".")[-1] in ("HandlerContext", "AsyncHandlerContext")
    return annotation in (HandlerContext, AsyncHandlerContext) or (
        annotation is inspect.Parameter.empty and first.name in ("ctx", "context")
    )


@dataclass(frozen=True)
class Subscription:
    """A handler and what it handles. `pattern` is a full routing key or topic pattern.

    A handler is called as ``handler(message, session)``, or ``handler(ctx)`` when its first
    parameter is a `HandlerContext` (annotated so, or named ``ctx``); either way a parameter
    named ``payload`` annotated with a dataclass or a pydantic model gets the decoded payload
    (outbox_inbox.payloads). `outbox` is the service's, for the context's publish and send.
    """

    kind: str
    pattern: str
    handler: Handler | AsyncHandler
    retry: RetryPolicy | None = None
    outbox: Any = None
    payload_type: type | None = field(init=False, default=None)
    takes_context: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload_type", declared_payload_type(self.handler))
        object.__setattr__(self, "takes_context", _takes_context(self.handler))
        if self.takes_context and self.outbox is None:
            raise ConfigurationError(
                f"handler {self.name} takes a context: register it with the service's "
                "on_command / on_event, which give the context its outbox"
            )

    @property
    def name(self) -> str:
        return getattr(self.handler, "__qualname__", repr(self.handler))

    @property
    def is_async(self) -> bool:
        return is_async_handler(self.handler)

    def call(self, message: Message, session: Session) -> Any:
        """Run the handler with `session`, the worker's Session in the marking transaction.

        An async handler gets an `AsyncSession` that proxies that same Session, awaited on
        the event loop of the asyncio worker: the worker's code runs in a greenlet over the
        async driver (`aio.AsyncWorker`), so what the handler awaits runs on the worker's
        connection, in its transaction. Outside that worker an async handler cannot run on
        the transaction: `ConfigurationError`, which the worker records as a handler failure.
        """
        payload = message.payload
        if self.payload_type is not None:
            payload = decode(payload, self.payload_type)  # InvalidPayload: dead at once
        typed = {"payload": payload} if self.payload_type is not None else {}
        call: Callable[..., Any] = self.handler
        if not self.is_async:
            if self.takes_context:
                return call(HandlerContext(message, session, payload, self.outbox), **typed)
            return call(message, session, **typed)
        if not in_greenlet():
            raise ConfigurationError(
                f"async handler {self.name} runs only in the asyncio worker: run the service"
                " with start(), run(), run_worker() or run_async(), which choose it"
            )
        proxy = AsyncSession(sync_session_class=lambda **_: session)  # type: ignore[arg-type]
        if self.takes_context:
            context = AsyncHandlerContext(message, proxy, payload, self.outbox)
            return await_only(call(context, **typed))
        return await_only(call(message, proxy, **typed))


class Handlers:
    """Subscriptions of one service. Register before `start()`; lookups are thread-safe."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        # find()'s answers by (kind, routing key): the worker asks for every message, and the
        # set of routing keys a service sees is small. Cleared whenever a handler is added.
        self._found: dict[tuple[str, str], list[Subscription]] = {}

    def add(self, subscription: Subscription) -> None:
        if not callable(subscription.handler):
            raise ConfigurationError(f"handler for {subscription.pattern!r} is not callable")
        for existing in self._subscriptions:
            if (
                existing.kind == COMMAND == subscription.kind
                and existing.pattern == subscription.pattern
            ):
                raise ConfigurationError(f"command {subscription.pattern!r} already has a handler")
        self._subscriptions.append(subscription)
        self._found = {}

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return tuple(self._subscriptions)

    @property
    def any_async(self) -> bool:
        """True when a handler is ``async def``: the service's workers are asyncio workers."""
        return any(s.is_async for s in self._subscriptions)

    def event_patterns(self) -> list[str]:
        return [s.pattern for s in self._subscriptions if s.kind == EVENT]

    def find(self, kind: str, routing_key: str) -> list[Subscription]:
        """Every subscription of `kind` matching `routing_key`, in registration order.

        The returned list is shared between callers: do not change it.
        """
        found = self._found.get((kind, routing_key))
        if found is None:
            if kind == COMMAND:
                found = [
                    s for s in self._subscriptions if s.kind == COMMAND and s.pattern == routing_key
                ]
            else:
                found = [
                    s
                    for s in self._subscriptions
                    if s.kind == EVENT and topic_matches(s.pattern, routing_key)
                ]
            if len(self._found) < 10_000:  # routing keys come from senders: keep it bounded
                self._found[(kind, routing_key)] = found
        return found
