"""The message being handled in this thread, so that what a handler sends carries its ids."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from .messages import Message

_current: contextvars.ContextVar[Message | None] = contextvars.ContextVar(
    "outbox_inbox_current_message", default=None
)


def current_message() -> Message | None:
    """The message whose handler is running in this context, or None."""
    return _current.get()


@contextmanager
def handling(message: Message) -> Iterator[None]:
    """Make `message` the current message for the duration of the block."""
    token = _current.set(message)
    try:
        yield
    finally:
        _current.reset(token)
