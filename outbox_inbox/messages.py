"""Messages as immutable values, and their wire format on AMQP (documented in docs/wire-format.md).

A message travels as a JSON body plus AMQP properties and headers:

* properties: ``message_id``, ``type`` (the routing key), ``correlation_id``, ``content_type``
  (``application/json``), ``timestamp`` (created_at, whole seconds), ``priority``, ``app_id``
  (the sending service), ``delivery_mode`` 2 (persistent);
* headers: ``x-kind`` (``command``/``event``), ``x-version``, ``x-causation-id``, ``x-key``
  (ordering key), ``x-created-at`` (ISO 8601, microseconds), ``x-expires-at``, ``x-attempt``,
  and the sender's own headers.

Only ``message_id`` and a JSON body are required, so a plain AMQP client in any language can send.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .errors import InvalidMessage, MessageError

COMMAND, EVENT = "command", "event"
COMMANDS_EXCHANGE, EVENTS_EXCHANGE = "commands", "events"
CONTENT_TYPE = "application/json"

#: Header names the library owns; a sender's own headers must not use them.
H_KIND = "x-kind"
H_VERSION = "x-version"
H_CAUSATION = "x-causation-id"
H_KEY = "x-key"
H_CREATED = "x-created-at"
H_EXPIRES = "x-expires-at"
H_ATTEMPT = "x-attempt"
H_ORIGINAL_ID = "x-original-message-id"
#: Transport headers: set by the receiver when it forwards a message to a delay tier or to the
#: dead letters, and not kept in the inbox row.
H_ORIGINAL_EXCHANGE = "x-original-exchange"
H_ORIGINAL_ROUTING_KEY = "x-original-routing-key"
H_RECEIVE_ATTEMPT = "x-receive-attempt"
H_RETRY_DELAY = "x-retry-delay-ms"
H_LAST_ERROR = "x-last-error"
H_DEAD_REASON = "x-dead-reason"
H_DEAD_QUEUE = "x-dead-queue"
TRANSPORT_HEADERS = frozenset(
    {
        H_ORIGINAL_EXCHANGE,
        H_ORIGINAL_ROUTING_KEY,
        H_RECEIVE_ATTEMPT,
        H_RETRY_DELAY,
        H_LAST_ERROR,
        H_DEAD_REASON,
        H_DEAD_QUEUE,
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
RESERVED_HEADERS = (
    frozenset(
        {H_KIND, H_VERSION, H_CAUSATION, H_KEY, H_CREATED, H_EXPIRES, H_ATTEMPT, H_ORIGINAL_ID}
    )
    | TRANSPORT_HEADERS
)

#: Namespace for turning a sender's non-UUID message id into the UUID the inbox keys on.
FOREIGN_ID_NAMESPACE = uuid.UUID("6f1c1c84-64a8-4a52-9a3e-3f0b43c5d1a7")


@dataclass(frozen=True)
class Message:
    """A received message, as a handler sees it. Immutable."""

    message_id: uuid.UUID
    type: str
    payload: Any
    kind: str = EVENT
    headers: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    version: int = 1
    correlation_id: str | None = None
    causation_id: str | None = None
    key: str | None = None
    priority: int = 0
    attempt: int = 1
    created_at: datetime | None = None
    expires_at: datetime | None = None


@dataclass(frozen=True)
class OutgoingMessage:
    """An outbox row on its way to the broker."""

    id: int
    message_id: uuid.UUID
    kind: str
    exchange: str
    routing_key: str
    payload: Any
    headers: Mapping[str, Any]
    source: str
    version: int = 1
    correlation_id: str | None = None
    causation_id: str | None = None
    key: str | None = None
    priority: int | None = None
    created_at: datetime | None = None
    expires_at: datetime | None = None
    attempt: int = 1


@dataclass(frozen=True)
class WireMessage:
    """What crosses the broker: body, AMQP properties (as plain values) and headers."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    type: str | None = None
    correlation_id: str | None = None
    content_type: str | None = CONTENT_TYPE
    timestamp: int | None = None
    priority: int | None = None
    app_id: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    key: str | None = None  # ordering key, for the publisher's in-flight rule


#: `json.dumps` with these options, without building an encoder for each call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_payload(payload: Any, *, limit: int | None = None) -> bytes:
    """Serialize `payload` to JSON bytes; raise MessageError, or PayloadTooLarge over `limit`."""
    try:
        body = _JSON.encode(payload)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"payload is not JSON-serializable: {exc}") from exc
    data = body.encode("utf-8")
    if limit is not None and len(data) > limit:
        from .errors import PayloadTooLarge

        raise PayloadTooLarge(f"payload is {len(data)} bytes, over the limit of {limit} bytes")
    return data


def check_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a JSON-safe copy of a sender's headers; reserved or non-JSON headers are refused."""
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise MessageError("headers must be a mapping of str to JSON values")
    clash = RESERVED_HEADERS.intersection(headers)
    if clash:
        raise MessageError(f"headers {sorted(clash)} are reserved by outbox_inbox")
    for name in headers:
        if not isinstance(name, str):
            raise MessageError(f"header names must be str, got {name!r}")
    encode_payload(dict(headers))
    return dict(headers)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def to_wire(message: OutgoingMessage, body: bytes | None = None) -> WireMessage:
    """Encode an outbox row for the broker."""
    headers: dict[str, Any] = dict(message.headers)
    headers[H_KIND] = message.kind
    headers[H_VERSION] = message.version
    headers[H_ATTEMPT] = message.attempt
    if message.causation_id:
        headers[H_CAUSATION] = message.causation_id
    if message.key is not None:
        headers[H_KEY] = message.key
    if message.created_at is not None:
        headers[H_CREATED] = _iso(message.created_at)
    if message.expires_at is not None:
        headers[H_EXPIRES] = _iso(message.expires_at)
    return WireMessage(
        exchange=message.exchange,
        routing_key=message.routing_key,
        body=body if body is not None else encode_payload(message.payload),
        message_id=str(message.message_id),
        type=message.routing_key,
        correlation_id=message.correlation_id,
        timestamp=int(message.created_at.timestamp()) if message.created_at else None,
        priority=message.priority,
        app_id=message.source,
        headers=headers,
        key=message.key,
    )


def _parse_time(value: Any, name: str) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError as exc:
        raise InvalidMessage(f"header {name} is not an ISO 8601 time: {value!r}") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _int(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"header {name} is not an integer: {value!r}") from exc


def inbox_id(message_id: str) -> uuid.UUID:
    """The UUID the inbox keys a message on: the id itself, or a stable UUID derived from it."""
    try:
        return uuid.UUID(message_id)
    except ValueError:
        return uuid.uuid5(FOREIGN_ID_NAMESPACE, message_id)


def from_wire(wire: WireMessage) -> dict[str, Any]:
    """Decode a delivery into inbox column values; raise InvalidMessage with the reason."""
    if not wire.message_id:
        raise InvalidMessage("message has no message_id property")
    if wire.content_type and not wire.content_type.startswith(CONTENT_TYPE):
        raise InvalidMessage(f"content type {wire.content_type!r} is not {CONTENT_TYPE}")
    try:
        payload = json.loads(wire.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidMessage(f"body is not JSON: {exc}") from exc
    raw_headers = dict(wire.headers or {})
    exchange = _text(raw_headers.get(H_ORIGINAL_EXCHANGE)) or wire.exchange
    routing_key = wire.type or _text(raw_headers.get(H_ORIGINAL_ROUTING_KEY)) or wire.routing_key
    for name in TRANSPORT_HEADERS:
        raw_headers.pop(name, None)
    raw_headers.pop(H_ATTEMPT, None)  # the relay's publish attempts: no business of a handler
    kind = _text(raw_headers.pop(H_KIND, None)) or (
        COMMAND if exchange == COMMANDS_EXCHANGE else EVENT
    )
    if kind not in (COMMAND, EVENT):
        raise InvalidMessage(f"header {H_KIND} must be command or event, got {kind!r}")
    message_uuid = inbox_id(wire.message_id)
    if str(message_uuid) != wire.message_id:
        raw_headers[H_ORIGINAL_ID] = wire.message_id
    created_at = _parse_time(raw_headers.pop(H_CREATED, None), H_CREATED)
    if created_at is None and wire.timestamp:
        created_at = datetime.fromtimestamp(wire.timestamp, UTC)
    priority = wire.priority or 0
    if not 0 <= priority <= 255:
        raise InvalidMessage(f"priority {priority} is outside 0..255")
    key = _text(raw_headers.pop(H_KEY, None))
    headers = {name: jsonable(value) for name, value in raw_headers.items()}
    return {
        "message_id": message_uuid,
        "source": wire.app_id,
        "kind": kind,
        "routing_key": routing_key,
        "payload": payload,
        "headers": headers,
        "version": _int(headers.pop(H_VERSION, None), H_VERSION, 1),
        "correlation_id": _text(wire.correlation_id),
        "causation_id": _text(headers.pop(H_CAUSATION, None)),
        "key": key,
        "priority": priority,
        "created_at": created_at,
        "expires_at": _parse_time(headers.pop(H_EXPIRES, None), H_EXPIRES),
    }


def jsonable(value: Any) -> Any:
    """AMQP header values (bytes, decimals, timestamps, nested tables) as JSON values."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def message_from_row(row: Mapping[Any, Any]) -> Message:
    """Build the handler's view of an inbox row."""
    return Message(
        message_id=row["message_id"],
        type=row["routing_key"],
        payload=row["payload"],
        kind=row["kind"],
        headers=dict(row["headers"] or {}),
        source=row["source"],
        version=row["version"],
        correlation_id=row["correlation_id"],
        causation_id=row["causation_id"],
        key=row["key"],
        priority=row["priority"],
        attempt=row["attempts"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
    )
