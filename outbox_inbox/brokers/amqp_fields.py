"""AMQP 0-9-1 message properties and field tables, decoded so that no sent value can fail. pika
decodes properties inside the connection's I/O: a value Python cannot represent (a ``T`` timestamp
past the year 9999, tables nested past the recursion limit) drops the connection, and the same
message comes back, forever. pika also turns ``f`` and ``d`` floats into integers, and cannot encode
floats at all. `decode_leniently(connection)` makes a connection decode with `decode_properties`,
which keeps what Python cannot represent as a `RawField` that encodes back to the same bytes;
`forward_properties` builds a forwarded copy's properties, encoded by `encode_table`, which never
fails on a value either."""

from __future__ import annotations

import decimal
import functools
import itertools
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pika
import pika.frame
import pika.spec
from pika.spec import BasicProperties

from ..messages import H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY, WireMessage, forwarded_headers

#: Tables and arrays nested deeper than this are kept as `RawField`s, not decoded.
MAX_DEPTH = 32

#: Header set on a forwarded copy whose original headers did not fit in one frame.
H_DROPPED_HEADERS = "x-dropped-headers"

#: The AMQP properties of a received message that `WireMessage` has no field of, kept in
#: `WireMessage.properties` so that a forwarded copy has them. (``expiration`` is not kept: a dead
#: letter must not expire, as RabbitMQ's own dead-lettering drops it too; ``user_id`` is not kept:
#: RabbitMQ refuses a publish whose ``user_id`` is not the publishing connection's user.)
KEPT_PROPERTIES = ("content_encoding", "reply_to", "cluster_id")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_U8, _U16, _U32, _I32, _I64, _U64, _F32, _F64 = map(
    struct.Struct, (">B", ">H", ">I", ">i", ">q", ">Q", ">f", ">d")
)
FRAME_HEADER = struct.Struct(">BHI")  # type, channel, payload size
CONTENT_HEADER = struct.Struct(">HHQ")  # class id, weight, body size


@dataclass(frozen=True, slots=True)
class RawField:
    """A field value kept as its encoded bytes: a timestamp out of Python's range, a long
    string that is not UTF-8, or a table or array nested deeper than `MAX_DEPTH`. ``str()``
    gives a readable form: a timestamp's number, a string's text (invalid bytes replaced)."""

    kind: bytes
    data: bytes

    def __str__(self) -> str:
        if self.kind == b"T":
            return str(_U64.unpack(self.data)[0])
        if self.kind == b"S":
            return self.data[4:].decode("utf-8", "replace")
        what = "table" if self.kind == b"F" else "array"
        return f"(an AMQP {what} nested deeper than {MAX_DEPTH} levels)"


class Float32(float):
    """A float that came as an AMQP ``f`` (32 bits), and is encoded as one again."""


def _short_string(data: bytes, offset: int) -> tuple[str | bytes, int]:
    """A short string: text, or the bytes themselves when they are not UTF-8 (as pika)."""
    length = data[offset]
    offset += 1
    raw = data[offset : offset + length]
    try:
        return raw.decode("utf-8"), offset + length
    except UnicodeDecodeError:
        return raw, offset + length


def decode_table(data: bytes, offset: int, depth: int = 0) -> tuple[dict[Any, Any], int]:
    """A field table at `offset`; returns it and the offset after it."""
    (size,) = _U32.unpack_from(data, offset)
    offset += 4
    end = offset + size
    table: dict[Any, Any] = {}
    while offset < end:
        name, offset = _short_string(data, offset)
        table[name], offset = decode_value(data, offset, depth)
    return table, offset


def decode_value(data: bytes, offset: int, depth: int = 0) -> tuple[Any, int]:
    """One field value (type octet and data) at `offset`; returns it and the offset after it.
    Raises ValueError only for a type octet no AMQP peer sends (RabbitMQ refuses those)."""
    kind = bytes(data[offset : offset + 1])  # bytes: a bytearray's slice cannot be a key
    offset += 1
    number = _NUMBERS.get(kind)
    if number is not None:
        return number.unpack_from(data, offset)[0], offset + number.size
    if kind in (b"S", b"x", b"F", b"A"):
        (length,) = _U32.unpack_from(data, offset)
        end = offset + 4 + length
        if kind == b"x":
            return bytes(data[offset + 4 : end]), end
        if kind == b"S":
            try:
                return data[offset + 4 : end].decode("utf-8"), end
            except UnicodeDecodeError:
                return RawField(kind, data[offset:end]), end
        if depth >= MAX_DEPTH:
            return RawField(kind, data[offset:end]), end
        if kind == b"F":
            return decode_table(data, offset, depth + 1)
        values = []
        offset += 4
        while offset < end:
            value, offset = decode_value(data, offset, depth + 1)
            values.append(value)
        return values, end
    if kind == b"T":
        (seconds,) = _U64.unpack_from(data, offset)
        try:
            return _EPOCH + timedelta(seconds=seconds), offset + 8
        except OverflowError:
            return RawField(kind, data[offset : offset + 8]), offset + 8
    if kind == b"t":
        return bool(data[offset]), offset + 1
    if kind == b"V":
        return None, offset
    if kind == b"f":
        return Float32(_F32.unpack_from(data, offset)[0]), offset + 4
    if kind == b"D":
        decimals = data[offset]
        (raw,) = _I32.unpack_from(data, offset + 1)
        return decimal.Decimal(raw).scaleb(-decimals), offset + 5
    raise ValueError(f"unknown AMQP field type {kind!r}")


#: The integers and doubles, decoded as they are: type octet -> their struct.
_NUMBERS = {
    bytes([t]): struct.Struct(">" + f) for t, f in zip(b"bBsUuIilLd", "bBhhHiIqqd", strict=True)
}


def decode_properties(data: bytes, offset: int = 0) -> BasicProperties:
    """The properties of a content header (class ``basic``), as pika's but never failing
    on a value (see the module's documentation)."""
    flags = 0
    for word in itertools.count():  # a set lowest bit: another word of flags follows
        (partial,) = _U16.unpack_from(data, offset)
        offset += 2
        flags |= partial << (word * 16)
        if not partial & 1:
            break
    props = BasicProperties()
    for name, flag, kind in PROPERTIES:
        if not flags & flag:
            continue
        value: Any
        if kind == "short":
            value, offset = _short_string(data, offset)
        elif kind == "octet":
            value = data[offset]
            offset += 1
        elif kind == "timestamp":
            (value,) = _U64.unpack_from(data, offset)
            offset += 8
        else:
            value, offset = decode_table(data, offset)
        setattr(props, name, value)
    return props


_P = BasicProperties
PROPERTIES = (
    ("content_type", _P.FLAG_CONTENT_TYPE, "short"),
    ("content_encoding", _P.FLAG_CONTENT_ENCODING, "short"),
    ("headers", _P.FLAG_HEADERS, "table"),
    ("delivery_mode", _P.FLAG_DELIVERY_MODE, "octet"),
    ("priority", _P.FLAG_PRIORITY, "octet"),
    ("correlation_id", _P.FLAG_CORRELATION_ID, "short"),
    ("reply_to", _P.FLAG_REPLY_TO, "short"),
    ("expiration", _P.FLAG_EXPIRATION, "short"),
    ("message_id", _P.FLAG_MESSAGE_ID, "short"),
    ("timestamp", _P.FLAG_TIMESTAMP, "timestamp"),
    ("type", _P.FLAG_TYPE, "short"),
    ("user_id", _P.FLAG_USER_ID, "short"),
    ("app_id", _P.FLAG_APP_ID, "short"),
    ("cluster_id", _P.FLAG_CLUSTER_ID, "short"),
)


def _read_frame(impl: Any) -> Any:
    """pika's `Connection._read_frame`, with content headers decoded by `decode_properties`."""
    data = impl._frame_buffer
    if data[:1] != b"\x02" or len(data) < 7:  # not a content header frame (or not whole yet)
        return pika.frame.decode_frame(data)
    _kind, channel_number, size = FRAME_HEADER.unpack_from(data)
    end = 7 + size + 1
    if end > len(data):
        return 0, None
    if data[end - 1] != pika.spec.FRAME_END:
        raise pika.exceptions.InvalidFrameError("Invalid FRAME_END marker")
    class_id, _weight, body_size = CONTENT_HEADER.unpack_from(data, 7)
    if class_id != BasicProperties.INDEX:
        return pika.frame.decode_frame(data)
    properties = decode_properties(data[19 : end - 1])
    return end, pika.frame.Header(channel_number, body_size, properties)


def decode_leniently(connection: pika.BlockingConnection) -> None:
    """Make `connection` decode message properties with `decode_properties`."""
    impl = connection._impl
    impl._read_frame = functools.partial(_read_frame, impl)


def kept_properties(props: BasicProperties) -> dict[str, Any]:
    """The properties of a delivery in `KEPT_PROPERTIES` that it has."""
    return {n: v for n in KEPT_PROPERTIES if (v := getattr(props, n, None)) is not None}


def _encode_short_string(pieces: list[bytes], value: str | bytes) -> None:
    data = (value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass"))[:255]
    pieces += (_U8.pack(len(data)), data)


def _encode_long(pieces: list[bytes], kind: bytes, data: bytes) -> None:
    pieces += (kind + _U32.pack(len(data)), data)


def encode_table(pieces: list[bytes], table: Mapping[Any, Any]) -> None:
    """Append a field table: every value encodes, as the closest AMQP type."""
    inner: list[bytes] = []
    for name, value in table.items():
        _encode_short_string(inner, name if isinstance(name, str | bytes) else str(name))
        encode_value(inner, value)
    _encode_long(pieces, b"", b"".join(inner))


def encode_value(pieces: list[bytes], value: Any) -> None:
    """Append one field value. Never fails: what has no AMQP type is sent as its text."""
    if isinstance(value, RawField):
        pieces.append(value.kind + value.data)
    elif isinstance(value, str):
        _encode_long(pieces, b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        _encode_long(pieces, b"x", bytes(value))
    elif isinstance(value, bool):
        pieces.append(b"t" + _U8.pack(int(value)))
    elif isinstance(value, int):
        if -(2**31) <= value < 2**31:
            pieces.append(b"I" + _I32.pack(value))
        elif -(2**63) <= value < 2**63:
            pieces.append(b"l" + _I64.pack(value))
        else:
            _encode_long(pieces, b"S", str(value).encode())
    elif isinstance(value, Float32):
        pieces.append(b"f" + _F32.pack(value))
    elif isinstance(value, float):
        pieces.append(b"d" + _F64.pack(value))
    elif isinstance(value, decimal.Decimal):
        _encode_decimal(pieces, value)
    elif isinstance(value, datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=UTC)
        seconds = math.floor((stamp - _EPOCH).total_seconds())
        if 0 <= seconds < 2**64:
            pieces.append(b"T" + _U64.pack(seconds))
        else:
            _encode_long(pieces, b"S", value.isoformat().encode())
    elif isinstance(value, Mapping):
        pieces.append(b"F")
        encode_table(pieces, value)
    elif isinstance(value, list | tuple):
        inner: list[bytes] = []
        for item in value:
            encode_value(inner, item)
        _encode_long(pieces, b"A", b"".join(inner))
    elif value is None:
        pieces.append(b"V")
    else:
        _encode_long(pieces, b"S", str(value).encode("utf-8", "surrogatepass"))


def _encode_decimal(pieces: list[bytes], value: decimal.Decimal) -> None:
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and exponent >= -255:
        decimals = max(0, -exponent)
        raw = int(value.scaleb(decimals))
        if -(2**31) <= raw < 2**31:
            pieces.append(b"D" + _U8.pack(decimals) + _I32.pack(raw))
            return
    _encode_long(pieces, b"S", str(value).encode())


def encode_properties(props: BasicProperties) -> list[bytes]:
    """The property flags and list of `props`, headers encoded by `encode_table`."""
    pieces: list[bytes] = []
    flags = 0
    for name, flag, kind in PROPERTIES:
        value = getattr(props, name, None)
        if value is None:
            continue
        flags |= flag
        if kind == "short":
            _encode_short_string(pieces, value)
        elif kind == "octet":
            pieces.append(_U8.pack(int(value) & 0xFF))
        elif kind == "timestamp":
            pieces.append(_U64.pack(int(value) & 0xFFFFFFFFFFFFFFFF))
        else:
            encode_table(pieces, value)
    return [_U16.pack(flags), *pieces]


class LenientProperties(BasicProperties):  # type: ignore[misc]
    """`BasicProperties` that pika writes with `encode_properties`: every header value
    encodes, those `decode_properties` gave (floats, `RawField`s) included. For republishing
    what a connection with `decode_leniently` received."""

    def encode(self) -> list[bytes]:
        return encode_properties(self)


def forward_properties(
    message: WireMessage, added: Mapping[str, Any], *, max_size: int
) -> BasicProperties:
    """The properties of a persistent copy of `message`: its properties (`KEPT_PROPERTIES` too)
    and headers, where it was first delivered (``x-original-exchange``, ``-routing-key``) and
    the `added` headers. Over `max_size` bytes (the frame), only the added and original-route
    headers stay, with ``x-dropped-headers`` saying how many bytes were dropped."""
    headers = forwarded_headers(message, added)
    props = LenientProperties(
        message_id=message.message_id or None,
        type=message.type,
        correlation_id=message.correlation_id,
        content_type=message.content_type,
        timestamp=message.timestamp,
        priority=message.priority,
        app_id=message.app_id,
        delivery_mode=pika.DeliveryMode.Persistent.value,
        headers=headers,
        **{k: v for k, v in message.properties.items() if k in KEPT_PROPERTIES},
    )
    size = sum(len(piece) for piece in encode_properties(props))
    if size > max_size:
        names = (H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY, *added)
        kept = {name: headers[name] for name in names if name in headers}
        kept[H_DROPPED_HEADERS] = f"{size} bytes of properties did not fit in one frame"
        props.headers = kept
    return props
