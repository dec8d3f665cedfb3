"""Messages as immutable values, and their wire format on AMQP: a JSON body plus properties and
headers (docs/wire-format.md). `to_wire` encodes an outbox row; `from_wire` checks every rule a
received message must meet, so that nothing it accepts is refused by PostgreSQL."""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import InvalidMessage, MessageError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_M = TypeVar("_M", bound="DataclassInstance")

COMMAND, EVENT = "command", "event"
COMMANDS_EXCHANGE, EVENTS_EXCHANGE = "commands", "events"
CONTENT_TYPE = "application/json"

#: Header names the library owns (docs/wire-format.md): a sender's own headers must not use them.
H_KIND = "x-kind"
H_VERSION = "x-version"
H_CAUSATION = "x-causation-id"
H_KEY = "x-key"
H_TENANT = "x-tenant"
H_CREATED = "x-created-at"
H_EXPIRES = "x-expires-at"
H_ATTEMPT = "x-attempt"
H_ORIGINAL_ID = "x-original-message-id"
#: The claim check (outbox_inbox.claim_check): the payload's reference ``<store>/<key>``, its
#: size in bytes and its SHA-256 (hex); the body is then JSON null.
H_PAYLOAD_REF, H_PAYLOAD_SIZE = "x-payload-ref", "x-payload-size"
H_PAYLOAD_SHA256 = "x-payload-sha256"
H_AMQP_TYPE = "x-amqp-type"
#: Transport headers: the receiver's, on a message it forwards; not kept in the inbox row.
H_ORIGINAL_EXCHANGE = "x-original-exchange"
H_ORIGINAL_ROUTING_KEY = "x-original-routing-key"
H_RECEIVE_ATTEMPT = "x-receive-attempt"
H_RETRY_DELAY = "x-retry-delay-ms"
H_LAST_ERROR = "x-last-error"
H_DEAD_REASON = "x-dead-reason"
H_DEAD_QUEUE = "x-dead-queue"
H_DEAD_FINGERPRINT = "x-dead-fingerprint"
#: The transport headers, and those the broker writes when it dead-letters a message itself.
TRANSPORT_HEADERS = frozenset[str]().union(
    (H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY, H_RECEIVE_ATTEMPT, H_RETRY_DELAY, H_LAST_ERROR),
    (H_DEAD_REASON, H_DEAD_QUEUE, H_DEAD_FINGERPRINT, "x-death"),
    ("x-first-death-exchange", "x-first-death-queue", "x-first-death-reason"),
    ("x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"),
)
#: Every header the library owns.
RESERVED_HEADERS = TRANSPORT_HEADERS.union(
    (H_KIND, H_VERSION, H_CAUSATION, H_KEY, H_TENANT, H_CREATED, H_EXPIRES),
    (H_ATTEMPT, H_ORIGINAL_ID, H_AMQP_TYPE, H_PAYLOAD_REF, H_PAYLOAD_SIZE, H_PAYLOAD_SHA256),
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
    #: The tenant its sender named (``x-tenant``); "" for none.
    tenant: str = ""
    priority: int = 0
    attempt: int = 1
    created_at: datetime | None = None
    expires_at: datetime | None = None
    #: When the receiver stored it (database clock); None where not known.
    received_at: datetime | None = None

    @property
    def original_id(self) -> str:
        """The id as its sender wrote it: `message_id`, unless the sender's id was not a UUID
        (the inbox keys the message on a UUID derived from it). What a handler sends carries it
        as its causation id, so the sender can match a reply to its command."""
        original = self.headers.get(H_ORIGINAL_ID)
        return original if isinstance(original, str) and original else str(self.message_id)


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
    #: Other AMQP properties of a received message (``content_encoding``, ``reply_to``,
    #: ``cluster_id``): checked or only kept, so that a forwarded copy has them. Not stored.
    properties: Mapping[str, Any] = field(default_factory=dict)


def forwarded_headers(message: WireMessage, added: Mapping[str, Any]) -> dict[str, Any]:
    """`message`'s headers, where it was first delivered (``x-original-exchange``,
    ``-routing-key``) unless they say already, and `added`: those of a forwarded copy."""
    first = {H_ORIGINAL_EXCHANGE: message.exchange, H_ORIGINAL_ROUTING_KEY: message.routing_key}
    return first | dict(message.headers) | dict(added)


#: `json.dumps` with these options, without building an encoder for each call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
#: How the encoder writes a key that was an int, a float, a bool or None ("1", "true").
_CONVERTED_KEY = re.compile(r'"(?:-?\d[\d.e+-]*|true|false|null)":')


def _first_unserializable(value: Any, path: str) -> str | None:
    """Where in `value` the first value JSON cannot hold is (``payload.items[2].price``), for
    the error message; None if it is not found."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} key {key!r}"
            if found := _first_unserializable(item, f"{path}.{key}"):
                return found
        return None
    if isinstance(value, list | tuple):
        for n, item in enumerate(value):
            if found := _first_unserializable(item, f"{path}[{n}]"):
                return found
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if value is None or isinstance(value, str | int | float | bool):
        return None
    return f"{path} ({type(value).__name__})"


def _check_keys(value: Any) -> None:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not all(isinstance(key, str) for key in node):
                raise TypeError("JSON object keys must be strings")
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def payload_json(payload: Any, *, limit: int | None = None) -> str:
    """`payload` as JSON text; raise MessageError, or PayloadTooLarge when its UTF-8 encoding
    is over `limit` bytes. A key that is not a string is refused: JSON would make ``{1: "a"}``
    ``{"1": "a"}``, and the handler would get a payload its sender never wrote."""
    try:
        text = _JSON.encode(payload)
        if _CONVERTED_KEY.search(text):  # walking every node costs more than the encoding
            _check_keys(payload)
    except (TypeError, ValueError) as exc:
        where = _first_unserializable(payload, "payload")
        raise MessageError(
            f"payload is not JSON-serializable: {where + ': ' if where else ''}{exc}"
        ) from exc
    # A character is at most 4 bytes of UTF-8: most payloads fit without being encoded.
    if limit is not None and len(text) * 4 > limit:
        size = len(text.encode("utf-8"))
        if size > limit:
            from .errors import PayloadTooLarge

            raise PayloadTooLarge(f"payload is {size} bytes, over the limit of {limit} bytes")
    return text


def check_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a JSON-safe copy of a sender's headers; reserved or non-JSON headers are refused."""
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise MessageError("headers must be a mapping of str to JSON values")
    if clash := RESERVED_HEADERS.intersection(headers):
        raise MessageError(f"headers {sorted(clash)} are reserved by outbox_inbox")
    for name in headers:
        if not isinstance(name, str):
            raise MessageError(f"header names must be str, got {name!r}")
    payload_json(dict(headers))
    return dict(headers)


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
        headers[H_CREATED] = message.created_at.isoformat()
    if message.expires_at is not None:
        headers[H_EXPIRES] = message.expires_at.isoformat()
    return WireMessage(
        exchange=message.exchange,
        routing_key=message.routing_key,
        body=body if body is not None else payload_json(message.payload).encode(),
        message_id=str(message.message_id),
        type=message.routing_key,
        correlation_id=message.correlation_id,
        timestamp=int(message.created_at.timestamp()) if message.created_at else None,
        priority=message.priority,
        app_id=message.source,
        headers=headers,
        key=message.key,
    )


# --- decoding what a sender put on the wire (the rules: docs/wire-format.md) ----------------

#: The longest text the inbox's text columns take: routing key, source, correlation and
#: causation ids, ordering key.
TEXT_MAX = 255
#: The most bytes of headers, as JSON, the receiver keeps with one message.
MAX_HEADER_BYTES = 64 * 1024
#: The deepest nesting of arrays and objects the receiver accepts in a body.
MAX_JSON_DEPTH = 256
#: A JSON escape that may decode to a character PostgreSQL's jsonb refuses: U+0000 or half of
#: a surrogate pair (a correct pair decodes to one character, and is then accepted).
_SUSPECT_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Units of an epoch number, told apart by size: below 10^11 it is seconds (up to the year
#: 5138), below 10^14 milliseconds, below 10^17 microseconds, below 10^20 nanoseconds.
_EPOCH_UNITS = ((10**11, 1_000_000), (10**14, 1_000), (10**17, 1), (10**20, None))
#: Content encodings that leave the body as it is.
_PLAIN_ENCODINGS = frozenset({"", "identity", "utf-8", "utf8"})


def is_json_media_type(content_type: str) -> bool:
    """True for ``application/json`` and ``application/<anything>+json``, with any parameters
    (``application/json; charset=utf-8``, ``application/cloudevents+json``)."""
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def epoch_time(value: int) -> datetime | None:
    """The time of an epoch number in seconds, milliseconds, microseconds or nanoseconds;
    None for zero, a negative number, or one past the year 9999."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    for below, micros in _EPOCH_UNITS:
        if value < below:
            offset = value * micros if micros else value // 1000
            try:
                return _EPOCH + timedelta(microseconds=offset)
            except OverflowError:
                return None
    return None


def _parse_time(value: Any, name: str) -> datetime | None:
    """An ISO 8601 text, an AMQP timestamp or an epoch number, as an aware UTC time."""
    if value is None:
        return None
    if isinstance(value, datetime):
        parsed = value
    else:
        text = _header_text(value, name).strip()
        # An epoch number (a header timestamp past Python's range comes as one, too).
        if text.isascii() and text.isdigit():
            stamp = epoch_time(int(text))
            if stamp is None:
                raise InvalidMessage(f"header {name} is not a time: {text!r}")
            return stamp
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError as exc:
            raise InvalidMessage(f"header {name} is not an ISO 8601 time: {value!r}") from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except OverflowError as exc:
        raise InvalidMessage(f"header {name} is out of range: {value!r}") from exc


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _informational(value: Any) -> str | None:
    """A text kept only for information (``app_id``, ``type``): never refused. What is not
    UTF-8, and U+0000, is replaced by U+FFFD."""
    text = _text(value)
    return text.replace("\x00", "\ufffd") if text else text


def _header_text(value: Any, name: str) -> str:
    return _property(value if isinstance(value, bytes) else str(value), f"header {name}") or ""


def _property(value: Any, name: str) -> str | None:
    """A text property that must be UTF-8 (pika hands over the bytes of one that is not)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidMessage(f"{name} is not UTF-8 text") from exc
    raise InvalidMessage(f"{name} is not text: {value!r}")


def _column(value: str | None, name: str) -> str | None:
    """`value` if a text column can hold it: at most TEXT_MAX characters, no U+0000."""
    if value and len(value) > TEXT_MAX:
        raise InvalidMessage(f"{name} is longer than {TEXT_MAX} characters")
    if value and "\x00" in value:
        raise InvalidMessage(f"{name} holds the character U+0000")
    return value


def _version(value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, bytes | str):
        text = _header_text(value, H_VERSION).strip()
        value = int(text) if text.isascii() and text.isdigit() else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
        raise InvalidMessage(f"header {H_VERSION} is not an integer in 1..2^31-1")
    return value


def inbox_id(message_id: str) -> uuid.UUID:
    """The UUID the inbox keys a message on: the id itself, or a stable UUID derived from it."""
    try:
        return uuid.UUID(message_id)
    except ValueError:
        return uuid.uuid5(FOREIGN_ID_NAMESPACE, message_id)


def decode_body(body: bytes, *, jsonb: bool = True) -> Any:
    """The JSON value of a body, if PostgreSQL's jsonb can store it (not checked without
    `jsonb`: the scans cost more than the parse of a large body); else InvalidMessage."""
    try:
        text = bytes(body).decode("utf-8-sig")  # a byte order mark is tolerated
    except UnicodeDecodeError as exc:
        raise InvalidMessage(f"body is not JSON: not UTF-8 text ({exc})") from exc
    try:
        payload = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError as exc:
        raise InvalidMessage(f"body is nested deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:
        raise InvalidMessage(f"body is not JSON: {exc}") from exc
    if jsonb and text.count("[") + text.count("{") > MAX_JSON_DEPTH and _too_deep(payload):
        raise InvalidMessage(f"body is nested deeper than {MAX_JSON_DEPTH} levels")
    if jsonb and _SUSPECT_ESCAPE.search(text):
        _check_strings(payload, "body")
    return payload


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _too_deep(value: Any) -> bool:
    if not isinstance(value, dict | list):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _check_strings(value: Any, where: str) -> None:
    """Raise InvalidMessage if a string of `value` holds U+0000 or an unpaired surrogate."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            found = _UNSTORABLE.search(node)
            if found:
                char = f"U+{ord(found.group()):04X}"
                what = "U+0000" if char == "U+0000" else f"an unpaired surrogate ({char})"
                raise InvalidMessage(f"{where} holds {what}, which PostgreSQL cannot store")
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


#: The inbox columns `from_wire` fills, in this order (the keys of its result).
RECEIVED_COLUMNS = (
    "message_id", "source", "kind", "routing_key", "payload", "headers", "version",
    "correlation_id", "causation_id", "key", "tenant", "priority", "created_at", "expires_at",
)  # fmt: skip
#: Of those, the ones that hold JSON values.
RECEIVED_JSON_COLUMNS = ("payload", "headers")


@cache
def _row_columns(cls: type[DataclassInstance]) -> tuple[tuple[str, str], ...]:
    """(field, column) for each field of `cls`: the column of its name (``type``: routing_key)."""
    return tuple((f.name, "routing_key" if f.name == "type" else f.name) for f in fields(cls))


def from_row(cls: type[_M], row: Mapping[Any, Any], **given: Any) -> _M:
    """The message dataclass `cls` (`Message`, `OutgoingMessage`, a test's view) of a table row:
    the one mapping of outbox and inbox columns to message fields. Each field takes the row's
    column of its name (``type`` the ``routing_key``; ``headers`` None as ``{}``) unless `given`
    sets it; a field whose column the row lacks keeps its default."""
    values = {f: row[c] for f, c in _row_columns(cls) if f not in given and c in row}
    if "headers" in values:
        values["headers"] = dict(values["headers"] or {})
    return cls(**values, **given)


def from_wire(wire: WireMessage, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Decode a delivery into inbox column values; raise InvalidMessage with the reason. Every
    rule of docs/wire-format.md is checked here: PostgreSQL refuses nothing this returns.
    `max_bytes` limits the body."""
    message_id = _column(_property(wire.message_id, "message_id"), "message_id")
    if not message_id:
        raise InvalidMessage("message has no message_id property")
    if max_bytes is not None and len(wire.body) > max_bytes:
        raise InvalidMessage(
            f"body is {len(wire.body)} bytes, over the limit of {max_bytes} (max_message_bytes)"
        )
    content_type = _property(wire.content_type, "content_type")
    if content_type and not is_json_media_type(content_type):
        raise InvalidMessage(f"content type {content_type!r} is not JSON")
    encoding = _property(wire.properties.get("content_encoding"), "content_encoding")
    if encoding and encoding.strip().lower() not in _PLAIN_ENCODINGS:
        raise InvalidMessage(f"content encoding {encoding!r} is not supported: send plain JSON")
    payload = decode_body(wire.body)

    if not isinstance(wire.headers, Mapping):
        raise InvalidMessage("headers are not a table")
    raw = {_text(name) or "": value for name, value in wire.headers.items()}
    exchange = _property(wire.exchange, "exchange") or ""
    routing_key = _property(wire.routing_key, "routing key") or ""
    if exchange not in (COMMANDS_EXCHANGE, EVENTS_EXCHANGE):
        # Back from a delay tier (`retry`) or replayed into the queue: where it was first sent.
        exchange = _text(raw.get(H_ORIGINAL_EXCHANGE)) or exchange
        routing_key = _text(raw.get(H_ORIGINAL_ROUTING_KEY)) or routing_key
    for name in (*TRANSPORT_HEADERS, H_ATTEMPT, H_ORIGINAL_ID, H_AMQP_TYPE):
        raw.pop(name, None)  # H_ATTEMPT: the relay's publish attempts, no business of a handler
    kind = _header_text(raw.pop(H_KIND, None) or "", H_KIND).strip().lower() or (
        COMMAND if exchange == COMMANDS_EXCHANGE else EVENT
    )
    if kind not in (COMMAND, EVENT):
        raise InvalidMessage(f"header {H_KIND} must be command or event, got {kind!r}")
    message_uuid = inbox_id(message_id)
    if str(message_uuid) != message_id:
        raw[H_ORIGINAL_ID] = message_id
    type_ = _informational(wire.type)
    if type_ and type_ != routing_key:  # informational: the routing key chooses the handler
        raw[H_AMQP_TYPE] = type_
    created_at = _parse_time(raw.pop(H_CREATED, None), H_CREATED)
    if created_at is None and wire.timestamp is not None:
        created_at = epoch_time(wire.timestamp)  # seconds, or ms/µs/ns as clients send
    expires_at = _parse_time(raw.pop(H_EXPIRES, None), H_EXPIRES)
    priority = 0 if wire.priority is None else wire.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255:
        raise InvalidMessage(f"priority {priority!r} is not an integer in 0..255")
    version = _version(raw.pop(H_VERSION, None))
    key_value = raw.pop(H_KEY, None)
    key = _header_text(key_value, H_KEY) if key_value is not None else None
    tenant = _header_text(raw.pop(H_TENANT, None) or "", H_TENANT)
    causation_value = raw.pop(H_CAUSATION, None)
    causation = _header_text(causation_value, H_CAUSATION) if causation_value else None
    correlation = _property(wire.correlation_id, "correlation_id")
    headers = {name: jsonable(value) for name, value in raw.items()}
    _check_strings(headers, "headers")
    size = len(json.dumps(headers, ensure_ascii=False).encode("utf-8"))
    if size > MAX_HEADER_BYTES:
        raise InvalidMessage(f"headers are {size} bytes as JSON, over {MAX_HEADER_BYTES}")
    return {
        "message_id": message_uuid,
        "source": _informational(wire.app_id),
        "kind": kind,
        "routing_key": _column(routing_key, "routing key"),
        "payload": payload,
        "headers": headers,
        "version": version,
        # A message sent without one starts a conversation: its own id, as its sender wrote it.
        "correlation_id": _column(correlation or message_id, "correlation_id"),
        "causation_id": _column(causation, H_CAUSATION),
        "key": _column(key or None, H_KEY),
        "tenant": _column(tenant, H_TENANT),
        "priority": priority,
        "created_at": created_at,
        "expires_at": expires_at,
    }


def jsonable(value: Any) -> Any:
    """AMQP header values (bytes, decimals, timestamps, nested tables) as JSON values; bytes
    become text, what is not UTF-8 (and U+0000, which PostgreSQL cannot store) U+FFFD."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").replace("\x00", "\ufffd")
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {_text(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def message_from_row(row: Mapping[Any, Any]) -> Message:
    """Build the handler's view of a claimed inbox row."""
    return from_row(Message, row, attempt=row["attempts"])


__all__ = ["Message", "OutgoingMessage", "WireMessage", "inbox_id"]
