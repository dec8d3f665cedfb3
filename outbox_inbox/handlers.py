"""The handler registry: which function handles which command or event."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from .errors import ConfigurationError
from .messages import COMMAND, EVENT, Message
from .retry import RetryPolicy
from .topology import topic_matches

Handler = Callable[[Message, Session], Any]


@dataclass(frozen=True)
class Subscription:
    """A handler and what it handles. `pattern` is a full routing key or topic pattern."""

    kind: str
    pattern: str
    handler: Handler
    retry: RetryPolicy | None = None

    @property
    def name(self) -> str:
        return getattr(self.handler, "__qualname__", repr(self.handler))


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
