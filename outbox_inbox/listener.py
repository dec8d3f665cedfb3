"""Hooks into the life of messages, for metrics, tracing and tests (docs/observability.md,
"Listener hooks"): every method is a no-op, override the ones you need. A hook runs in its
role's hot path; one that raises is logged and otherwise ignored. `Listeners` (or `combine`)
makes several listeners one."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from .broker import PublishOutcome
from .messages import Message, OutgoingMessage

log = logging.getLogger(__name__)


class Listener:
    #: True for a listener that must see the hooks of every process in the one that runs the
    #: service (the Prometheus metrics it serves): in a forked worker process its hooks are sent
    #: to that process (outbox_inbox.supervisor), which calls its ``forwarded_<hook>`` methods.
    forwarded_from_workers = False

    def relay_confirmed(
        self, messages: Sequence[OutgoingMessage], outcomes: Sequence[PublishOutcome]
    ) -> None:
        """A batch was published; its rows are not yet marked (the transaction is open)."""

    def relay_committed(self, messages: Sequence[OutgoingMessage]) -> None:
        """These messages are marked published and committed."""

    def received(self, stored: int, duplicates: int) -> None:
        """The receiver committed `stored` new rows, and dropped (acked) `duplicates`
        deliveries as copies of a message stored before or earlier in the same batch."""

    def handled(self, message: Message) -> None:
        """The handlers of `message` returned; it commits with the worker's batch."""

    def failed(self, message: Message, error: BaseException, *, dead: bool) -> None:
        """A handler failed; retried later, or (`dead`) not: dead, or lost (``at_most_once``)."""

    def stored(self, messages: Sequence[Message]) -> None:
        """The receiver committed these new inbox rows (not duplicates; `attempt` is 0)."""

    def handler_ran(self, message: Message, seconds: float, error: BaseException | None) -> None:
        """The handlers of `message` ran for `seconds` (wall clock) and raised `error`, or
        returned (None). Called for each run, before the worker's transaction commits."""

    def dead(self, reason: str, count: int) -> None:
        """`count` messages are dead for `reason`: a worker's dead reason (``rejected``,
        ``max_attempts``, ``abandoned``, ``interrupted``, ``expired``, ``no_handler``; ``lost``: an
        ``at_most_once`` message whose handler failed, its row processed), a receiver's
        (``invalid``, ``store_failed``, ``redelivered``: sent to the dead-letter queue) or the
        relay's (``refused``: the outbox row)."""


class Listeners(Listener):
    """Several listeners as one: each hook calls every listener in order; one that raises is
    logged and does not keep the hook from the others."""

    def __init__(self, *listeners: Listener) -> None:
        self.listeners = tuple(listeners)


def _fan_out(hook: str) -> Callable[..., None]:
    def each(self: Listeners, *args: object, **kwargs: object) -> None:
        for listener in self.listeners:
            call(listener, hook, *args, **kwargs)

    each.__name__, each.__qualname__ = hook, f"Listeners.{hook}"
    return each


#: The hooks of a `Listener`: `Listeners` calls each on every listener it holds.
HOOKS = tuple(name for name, value in vars(Listener).items() if callable(value))
for _hook in HOOKS:
    setattr(Listeners, _hook, _fan_out(_hook))


def combine(*listeners: Listener | None) -> Listener | None:
    """One listener for those given (None ones left out): None, the only one, or `Listeners`."""
    present = [listener for listener in listeners if listener is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else Listeners(*present)


def call(listener: Listener | None, hook: str, *args: object, **kwargs: object) -> None:
    """Call `listener.<hook>(...)`, logging instead of raising what it raises."""
    if listener is None:
        return
    try:
        getattr(listener, hook)(*args, **kwargs)
    except Exception:
        log.exception("listener hook %s failed", hook)


def forwarded(listener: Listener | None) -> list[Listener]:
    """The listeners among `listener` whose hooks worker processes forward (see `Listener`)."""
    found = listener.listeners if isinstance(listener, Listeners) else (listener,)
    return [each for each in found if each is not None and each.forwarded_from_workers]


def forwarding(listener: Listener | None, forwarder: Listener) -> Listener | None:
    """`listener` with each listener whose hooks are forwarded replaced by `forwarder`."""
    if isinstance(listener, Listeners):
        return Listeners(
            *(forwarder if x.forwarded_from_workers else x for x in listener.listeners)
        )
    return forwarder if listener is not None and listener.forwarded_from_workers else listener


__all__ = ["Listener", "Listeners", "combine"]
