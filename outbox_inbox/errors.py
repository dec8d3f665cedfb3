"""The exceptions this library raises. Driver errors are translated at the adapter boundary."""

from __future__ import annotations


class OutboxInboxError(Exception):
    """Base of every error raised by outbox_inbox."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or self.__class__.__name__).strip())


class ConfigurationError(OutboxInboxError, ValueError):
    """The configuration is invalid."""


class MessageError(OutboxInboxError, ValueError):
    """A message cannot be written or read."""


class PayloadTooLarge(MessageError):
    """The encoded payload is larger than the configured limit."""


class InvalidMessage(MessageError):
    """A received message does not carry a valid envelope."""


class StorageError(OutboxInboxError):
    """The database refused or failed an operation."""


class SchemaMissing(StorageError):
    """The outbox/inbox tables do not exist: run `outbox-inbox db upgrade`."""


class BrokerError(OutboxInboxError):
    """The message broker failed an operation."""


class BrokerConnectionError(BrokerError):
    """The message broker cannot be reached."""


class TopologyMismatch(BrokerError):
    """The broker holds an exchange or queue declared with other arguments."""


class HandlerOutcome(Exception):
    """Base of the exceptions a handler raises to choose what happens to its message."""


class Retry(HandlerOutcome):
    """Handle the message again later: after `delay` seconds, or by the retry policy if None."""

    def __init__(self, delay: float | None = None, reason: str | None = None) -> None:
        if delay is not None and delay < 0:
            raise ConfigurationError("Retry delay must be >= 0")
        self.delay = delay
        self.reason = reason
        super().__init__(reason or "retry requested by handler")


class Reject(HandlerOutcome):
    """The message can never succeed: make it dead at once, with `reason`, without retrying."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def storage_error(exc: BaseException, action: str) -> StorageError:
    """Translate a SQLAlchemy/driver error raised while doing `action` into a StorageError."""
    original = getattr(exc, "orig", None)
    if getattr(original, "sqlstate", None) == "42P01":  # undefined_table
        return SchemaMissing(
            f"{action}: the outbox/inbox tables are missing; run `outbox-inbox db upgrade` "
            "(or Service.migrate())"
        )
    first = str(original or exc).splitlines()[0] if str(original or exc) else repr(exc)
    return StorageError(f"{action} failed: {first}")
