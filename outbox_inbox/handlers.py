"""The handler registry: which function handles which command or event."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

from .errors import ConfigurationError
from .messages import COMMAND, EVENT, Message
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
class Subscription:
    """A handler and what it handles. `pattern` is a full routing key or topic pattern."""

    kind: str
    pattern: str
    handler: Handler | AsyncHandler
    retry: RetryPolicy | None = None

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
        if not self.is_async:
            return cast(Handler, self.handler)(message, session)
        if not in_greenlet():
            raise ConfigurationError(
                f"async handler {self.name} runs only in the asyncio worker: run the service"
                " with start(), run(), run_worker() or run_async(), which choose it"
            )
        proxy = AsyncSession(sync_session_class=lambda **_: session)  # type: ignore[arg-type]
        handler = cast(AsyncHandler, self.handler)
        return await_only(handler(message, proxy))


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
