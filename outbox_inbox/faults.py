"""Fault messages: what a service tells a command's sender when the command ended dead there.
Written in the transaction of the dead mark (docs/failures.md, "A fault back to the sender"), a
fault is a command to the sender routed ``<sender>.fault.<original routing key>``, which the
sender's own binding ``<sender>.#`` takes; its JSON payload is a `Fault` (docs/wire-format.md).
Events get one only with ``event_faults``; a fault never gets a fault of its own."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from .config import validate_service_name
from .context import handling
from .errors import ConfigurationError, MessageError, StorageError, first_line
from .fingerprint import fingerprint
from .messages import COMMAND, EVENT, Message
from .outbox import Outbox, _check_name

log = logging.getLogger(__name__)

#: The routing key's word after the sender's name that makes a command a fault; a service's
#: own commands may not start with it (`Service.on_command` refuses ``fault.…``).
FAULT = "fault"
#: The longest routing key a row holds (the column's length, and AMQP's 255 bytes).
_MAX_KEY = 255
#: The longest error line a fault carries.
_MAX_ERROR = 1000


@dataclass(frozen=True)
class Fault:
    """The payload of a fault message: a message that ended dead at `service`. A handler registered
    with `Service.on_fault` gets it as its typed payload when it declares ``payload: Fault``. Each
    field is described in docs/wire-format.md ("Faults")."""

    message_id: str
    routing_key: str
    kind: str
    service: str
    reason: str
    fingerprint: str
    error: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


def fault_routing_key(sender: str, routing_key: str) -> str:
    """The routing key of the fault of a message routed `routing_key`, back to `sender`."""
    return f"{sender}.{FAULT}.{routing_key}"


def is_fault(routing_key: str) -> bool:
    """True when a command's `routing_key` is a fault's (``<service>.fault.…``)."""
    words = routing_key.split(".", 2)
    return len(words) == 3 and words[1] == FAULT


def send_fault(
    conn: Connection,
    outbox: Outbox,
    message: Message,
    reason: str,
    error: str | None,
    cause: BaseException | None,
    *,
    events: bool,
) -> uuid.UUID | None:
    """Write the fault of the inbox row of `message`, dead for `reason`, into `outbox` in
    `conn`'s transaction (never committed here); return its message id, or None when none is
    due: an event while `events` is False, a fault itself, a sender that is no service, a
    routing key that cannot make a fault's. Raises SQLAlchemyError when the database refuses
    the write (the caller's transaction, and with it the dead mark, then fails too)."""
    kind, routing_key = message.kind, message.type
    if (kind == EVENT and not events) or (kind == COMMAND and is_fault(routing_key)):
        return None
    try:
        sender = validate_service_name(message.source or "")
    except ConfigurationError:
        log.debug("no fault for %s: %r is not a service", message.message_id, message.source)
        return None
    key = fault_routing_key(sender, routing_key)
    try:
        _check_name(key, "fault routing key")
        if len(key.encode()) > _MAX_KEY:
            raise MessageError(f"fault routing key {key!r} is over {_MAX_KEY} bytes")
    except MessageError as exc:
        log.warning("no fault for %s: %s", message.message_id, exc)
        return None
    line = first_line(cause) if cause is not None else (error or "").split("\n", 1)[0]
    fault = Fault(
        message_id=message.original_id,
        routing_key=routing_key,
        kind=kind,
        service=outbox.service,
        reason=reason,
        fingerprint=fingerprint(reason, cause),
        error=line[:_MAX_ERROR] or None,
        correlation_id=message.correlation_id,
        causation_id=message.causation_id,
    )
    try:
        with handling(message):  # the fault's causation: the dead message; correlation: its
            return outbox.send(conn, sender, f"{FAULT}.{routing_key}", fault, key=message.key)
    except StorageError as exc:
        if isinstance(exc.__cause__, SQLAlchemyError):
            # As any failed statement of the worker's transaction: its batch fails, no mark.
            raise exc.__cause__ from None
        raise


def log_unhandled_fault(message: Message, session: Session) -> None:
    """What the worker does with a fault that no `Service.on_fault` handler matches: an INFO
    line naming it; the fault is then processed like any handled message."""
    payload = message.payload if isinstance(message.payload, dict) else {}
    log.info(
        "fault from %s: %s %s is dead (%s: %s); no on_fault handler",
        message.source,
        payload.get("routing_key"),
        payload.get("message_id"),
        payload.get("reason"),
        payload.get("error"),
        extra={"message_id": str(message.message_id), "routing_key": message.type},
    )
