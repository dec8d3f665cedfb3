"""Hooks into the life of messages, for metrics, tracing and tests.

Every method is a no-op; override the ones you need. A hook runs in the thread of the role that
calls it; an exception it raises is logged and otherwise ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .broker import PublishOutcome
from .messages import Message, OutgoingMessage

log = logging.getLogger(__name__)


class Listener:
    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        """A batch was published; its rows are not yet marked (the transaction is open)."""

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        """These messages are marked published and committed."""

    def received(self, stored: int, duplicates: int) -> None:
        """The receiver committed a batch: `stored` new rows, `duplicates` dropped."""

    def handled(self, message: Message) -> None:
        """The handlers of `message` returned; it commits with the worker's batch."""

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        """A handler failed; the message is retried later, or is dead if `dead`."""


def call(listener: Listener | None, hook: str, *args: object, **kwargs: object) -> None:
    """Call `listener.<hook>(...)`, logging instead of raising what it raises."""
    if listener is None:
        return
    try:
        getattr(listener, hook)(*args, **kwargs)
    except Exception:
        log.exception("listener hook %s failed", hook)
