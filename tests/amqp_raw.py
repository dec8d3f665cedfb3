"""Publishing messages whose properties and headers are given as raw AMQP bytes.

pika refuses to send much of what other clients send (floats, timestamps past the year 9999,
strings that are not UTF-8 in a table, deep nesting), so tests that play a foreign sender build
the encoded property list themselves. The encoding here is written from the AMQP 0-9-1 spec
and RabbitMQ's errata, independently of the library's own codec.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

import pika
import pika.exceptions
from pika.spec import BasicProperties

# --- field values: each function returns the type octet and the data -----------------------


def long_string(data: bytes | str) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return b"S" + struct.pack(">I", len(raw)) + raw


def byte_array(data: bytes) -> bytes:
    return b"x" + struct.pack(">I", len(data)) + data


def timestamp(seconds: int) -> bytes:
    return b"T" + struct.pack(">Q", seconds)


def double(value: float) -> bytes:
    return b"d" + struct.pack(">d", value)


def float32(value: float) -> bytes:
    return b"f" + struct.pack(">f", value)


def integer(kind: bytes, value: int) -> bytes:
    formats = {b"b": ">b", b"B": ">B", b"s": ">h", b"u": ">H", b"I": ">i", b"i": ">I", b"l": ">q"}
    return kind + struct.pack(formats[kind], value)


def decimal_value(decimals: int, raw: int) -> bytes:
    return b"D" + struct.pack(">Bi", decimals, raw)


def boolean(value: bool) -> bytes:
    return b"t" + bytes([int(value)])


VOID = b"V"


def short_string(data: bytes | str) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    assert len(raw) <= 255
    return bytes([len(raw)]) + raw


def table_body(entries: Iterable[tuple[bytes | str, bytes]]) -> bytes:
    """A field table (with its size) from (name, encoded value) pairs."""
    data = b"".join(short_string(name) + value for name, value in entries)
    return struct.pack(">I", len(data)) + data


def table(entries: Iterable[tuple[bytes | str, bytes]]) -> bytes:
    return b"F" + table_body(entries)


def array(values: Iterable[bytes]) -> bytes:
    data = b"".join(values)
    return b"A" + struct.pack(">I", len(data)) + data


def nested_arrays(depth: int) -> bytes:
    value = array([])
    for _ in range(depth):
        value = array([value])
    return value


# --- properties ------------------------------------------------------------------------------

_SHORT = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
)
_ORDER = (
    ("content_type", 0x8000),
    ("content_encoding", 0x4000),
    ("headers", 0x2000),
    ("delivery_mode", 0x1000),
    ("priority", 0x0800),
    ("correlation_id", 0x0400),
    ("reply_to", 0x0200),
    ("expiration", 0x0100),
    ("message_id", 0x0080),
    ("timestamp", 0x0040),
    ("type", 0x0020),
    ("user_id", 0x0010),
    ("app_id", 0x0008),
    ("cluster_id", 0x0004),
)


def encode_properties(props: Mapping[str, Any]) -> bytes:
    """The property flags and list: short strings as str or bytes, ``headers`` as the
    encoded table (`table_body`), octets and the timestamp as ints."""
    flags = 0
    pieces = []
    for name, flag in _ORDER:
        value = props.get(name)
        if value is None:
            continue
        flags |= flag
        if name in _SHORT:
            pieces.append(short_string(value))
        elif name == "headers":
            pieces.append(value)
        elif name == "timestamp":
            pieces.append(struct.pack(">Q", value))
        else:
            pieces.append(bytes([value]))
    return struct.pack(">H", flags) + b"".join(pieces)


class RawProperties(BasicProperties):  # type: ignore[misc]
    """Properties that pika sends as the given bytes."""

    def __init__(self, encoded: bytes) -> None:
        super().__init__()
        self._encoded = encoded

    def encode(self) -> list[bytes]:
        return [self._encoded]


class RawPublisher:
    """Publishes with confirms; reconnects when the broker closed the connection (it closes it
    on a message it refuses outright, such as a NaN in a table)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None

    def _open(self) -> Any:
        if self._connection is None or not self._connection.is_open:
            self._connection = pika.BlockingConnection(pika.URLParameters(self._url))
            self._channel = self._connection.channel()
            self._channel.confirm_delivery()
        return self._channel

    def publish(
        self,
        exchange: str,
        routing_key: bytes | str,
        body: bytes,
        props: Mapping[str, Any] | bytes,
    ) -> bool:
        """Publish; True when the broker confirmed it, False when it refused it."""
        encoded = props if isinstance(props, bytes) else encode_properties(props)
        channel = self._open()
        try:
            channel.basic_publish(exchange, routing_key, body, RawProperties(encoded))
        except (pika.exceptions.AMQPError, OSError):
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._connection is not None:
            try:
                if self._connection.is_open:
                    self._connection.close()
            except (pika.exceptions.AMQPError, OSError):
                pass
        self._connection = None
