"""The exceptions this library raises. Driver errors are translated at the adapter boundary."""

from __future__ import annotations

import psycopg


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


class DatabaseUnavailable(StorageError):
    """The database cannot be reached now (refused, timed out, shutting down): it may come back."""


class CommitOutcomeUnknown(DatabaseUnavailable):
    """The commit's outcome is unknown (its connection was lost): it may have committed; retry
    it idempotently, with the same message id or business key (docs/failures.md)."""


class SchemaMissing(StorageError):
    """The outbox/inbox tables do not exist: run `outbox-inbox db upgrade`."""


class BrokerError(OutboxInboxError):
    """The message broker failed an operation."""


class BrokerConnectionError(BrokerError):
    """The message broker cannot be reached."""


class BrokerAccessRefused(BrokerConnectionError):
    """The broker refused the credentials or the virtual host: a configuration error."""


class TopologyMismatch(BrokerError):
    """The broker holds an exchange or queue declared with other arguments."""


class TopologyMissing(BrokerError):
    """The broker lacks a queue the service needs: run `outbox-inbox topology apply`."""


class HandlerOutcome(Exception):
    """Base of the exceptions a handler raises to choose what happens to its message."""


class Retry(HandlerOutcome):
    """Handle the message again later: after `delay` seconds, or by the retry policy if None."""

    def __init__(self, delay: float | None = None, reason: str | None = None) -> None:
        if delay is not None and delay < 0:
            raise ConfigurationError("Retry delay must be >= 0")
        self.delay, self.reason = delay, reason
        super().__init__(reason or "retry requested by handler")


class Reject(HandlerOutcome):
    """The message can never succeed: make it dead at once, with `reason`, without retrying."""

    #: The inbox row's dead_reason.
    dead_reason = "rejected"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class InvalidPayload(Reject):
    """The payload does not fit the type its handler declared: dead at once, never retried,
    as ``invalid_payload`` with the decoder's words (outbox_inbox.payloads)."""

    dead_reason = "invalid_payload"


class PayloadMissing(Reject):
    """A payload sent by reference (the claim check) is not in a store known here, or does not
    match its size and SHA-256: dead at once as ``payload_missing``, never retried."""

    dead_reason = "payload_missing"


class HandlerExited(OutboxInboxError):
    """A handler raised an exception that is not an `Exception` (``SystemExit`` from
    ``sys.exit()``, ``KeyboardInterrupt``, ``GeneratorExit``): a handler failure like any
    other, retried by the handler's policy, never the end of the worker that ran it."""

    def __init__(self, handler: str, exit: BaseException) -> None:
        self.handler, self.exit = handler, exit
        super().__init__(f"handler {handler} raised {exit!r}")


def first_line(error: object) -> str:
    """The first line of an error's text (a driver's may go on with a statement), else its repr."""
    text = str(error)
    return text.splitlines()[0] if text else repr(error)


def storage_error(exc: BaseException, action: str) -> StorageError:
    """Translate a SQLAlchemy/driver error raised while doing `action` into a StorageError."""
    original = getattr(exc, "orig", None)
    if getattr(original, "sqlstate", None) == "42P01":  # undefined_table
        return SchemaMissing(
            f"{action}: the outbox/inbox tables are missing; run `outbox-inbox db upgrade` "
            "(or Service.migrate())"
        )
    first = first_line(original or exc)
    if missing_partition(exc):
        return StorageError(
            f"{action} failed: {first}: no partition covers this time yet; the roles make "
            "them ahead at start and every maintenance_interval: start a role or run "
            "`outbox-inbox partitions maintain` (docs/history.md#retention)"
        )
    if database_unreachable(exc):
        return DatabaseUnavailable(f"{action} failed: {first}")
    return StorageError(f"{action} failed: {first}")


def escaped_error(exc: BaseException) -> OutboxInboxError | None:
    """This library's error for a database (SQLAlchemy) or broker (pika) error that reached
    the caller untranslated: `storage_error`'s, as ``database error: <first line>``, or a
    BrokerError naming the pika error; None for any other exception."""
    import pika.exceptions
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(exc, SQLAlchemyError):
        error = storage_error(exc, "database")
        if isinstance(error, SchemaMissing):
            return error
        return type(error)(str(error).replace("database failed: ", "database error: ", 1))
    if isinstance(exc, pika.exceptions.AMQPError):
        text = str(exc).strip() or repr(exc)
        return BrokerError(f"{type(exc).__name__}: {text.splitlines()[0]}")
    return None


def missing_partition(exc: BaseException) -> bool:
    """True when PostgreSQL refused a row because no partition covers its time (SQLSTATE
    23514 with its own words): the partitions were not made ahead, not the row's fault."""
    original = getattr(exc, "orig", None) or exc
    refused = getattr(original, "sqlstate", None) == "23514"
    return refused and "no partition of relation" in str(original)


#: SQLSTATEs of a server going away or not ready: 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03
#: cannot_connect_now (starting up), 53300 too_many_connections; and of one short of a resource
#: that comes back with the statement unchanged: 53100 disk_full ("could not extend file": space
#: is freed or added) and 53200 out_of_memory (taken by the server's other sessions). Not 53400
#: configuration_limit_exceeded: a setting, which waiting does not change.
_TRANSIENT_STATES = {"57P01", "57P02", "57P03", "53100", "53200", "53300"}
#: What PostgreSQL says when the connection settings themselves are wrong.
_REFUSALS = ("password authentication failed", "does not exist", "no pg_hba.conf entry")


def read_only_session(exc: BaseException) -> bool:
    """True when `exc` (a SQLAlchemy or psycopg error) is SQLSTATE 25006 (a read-only
    transaction): a session on a standby, as in a failover; an outage, not the statement's."""
    original = getattr(exc, "orig", None) or exc
    return getattr(original, "sqlstate", None) == "25006"


def database_unreachable(exc: BaseException) -> bool:
    """True when `exc` (a SQLAlchemy or psycopg error) means the database cannot be reached,
    or cannot work, now: a refused, reset or timed-out connection, a server shutting down or
    starting up, out of disk or memory, a standby (`read_only_session`). Wrong credentials, a
    missing database or role, and every other SQL error are not."""
    if getattr(exc, "connection_invalidated", False) or read_only_session(exc):
        return True
    original = getattr(exc, "orig", None) or exc
    if not isinstance(original, psycopg.OperationalError):
        return False
    state = getattr(original, "sqlstate", None)
    if state:
        return bool(state.startswith("08") or state in _TRANSIENT_STATES)
    message = str(original).lower()
    return not any(refusal in message for refusal in _REFUSALS)
