"""RabbitMQ through pika: one BlockingConnection per publisher or consumer, owned by one thread."""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import pika
import pika.data
import pika.exceptions
import pika.frame
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from ..broker import Delivery, PublishOutcome, Refusal
from ..config import broker_urls
from ..errors import (
    BrokerAccessRefused,
    BrokerConnectionError,
    BrokerError,
    ConfigurationError,
    TopologyMismatch,
    TopologyMissing,
)
from ..logsafe import mask_text, mask_url
from ..messages import WireMessage
from ..topology import Exchange, Queue, Topology
from .amqp_connection import CONNECTION_ERRORS, close_quietly, declare_on, wire_message
from .amqp_fields import CONTENT_HEADER, FRAME_HEADER, decode_leniently, forward_properties
from .rabbitmq_admin import RabbitMQAdmin

log = logging.getLogger(__name__)


class _AtDebug(logging.Filter):
    """Log pika's own lines of a logger at DEBUG: all of them, or those of format `only`. They
    repeat what the roles report themselves: an outage (pika logs ERROR lines and a traceback
    per failed connection attempt), and a blocking (`FlowControl` logs it once)."""

    def __init__(self, only: str | None = None) -> None:
        super().__init__()
        self._only = only

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and self._only in (None, record.msg):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # The logger's level check passed at the record's own level: ask again at DEBUG,
            # or the relabelled record (and its traceback) is printed all the same.
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


for _name in (
    "pika.adapters.utils.connection_workflow",
    "pika.adapters.utils.io_services_utils",
    "pika.adapters.blocking_connection",
    "pika.adapters.base_connection",  # e.g. an idle pooled connection found closed
):
    logging.getLogger(_name).addFilter(_AtDebug())
# pika.connection's line for those two frames.
logging.getLogger("pika.connection").addFilter(_AtDebug("Received %s from broker"))

#: Errors of a login the broker refused (credentials, virtual host).
_REFUSALS: tuple[type[BaseException], ...] = (
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
    pika.exceptions.AuthenticationError,
)


#: TCP keepalive of every connection (idle, interval, count, in seconds), and how long unacked
#: sent data may wait (ms): a dead link is noticed even while a role only sends.
_TCP_OPTIONS = dict(TCP_KEEPIDLE=10, TCP_KEEPINTVL=5, TCP_KEEPCNT=3, TCP_USER_TIMEOUT=30_000)


class RabbitMQBroker:
    """RabbitMQ at `url` (``amqp://user:password@host:port/vhost``), or the nodes of a cluster
    (``amqp://user:password@node1:5672,node2:5672/vhost``: see `config.broker_urls`). Every
    connection it opens negotiates AMQP heartbeats of `heartbeat` seconds (unless the URL sets
    ``heartbeat=``), uses TCP keepalive, gives up connecting after `connect_timeout`, and is broken
    once blocked for `blocked_connection_timeout` (docs/configuration.md says what each bounds).
    Blocking and unblocking are logged and counted in `flow_control`. Publishers come from a pool of
    at most `publisher_connections` connections of their own, never a consumer's (`_PublisherPool`),
    waiting `publisher_checkout_timeout` s for a free one."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 10.0,
        heartbeat: float = 5.0,
        blocked_connection_timeout: float = 30.0,
        publisher_connections: int = 2,
        publisher_checkout_timeout: float = 5.0,
    ) -> None:
        self._urls = broker_urls(url)
        self._params: list[pika.URLParameters] = []
        for one in self._urls:
            try:
                params = pika.URLParameters(one)
            except Exception as exc:  # pika raises several types for a bad URL
                # pika's message quotes parts of the URL (a password read as a port): masked,
                # and not chained, so that no traceback prints it.
                raise ConfigurationError(
                    f"invalid broker URL {mask_url(one)}: {mask_text(exc, one)} (a '/', ':' or "
                    "'@' in the user name or password must be written %2F, %3A or %40)"
                ) from None
            params.socket_timeout = connect_timeout
            params.stack_timeout = connect_timeout
            params.blocked_connection_timeout = blocked_connection_timeout
            params.connection_attempts = 1
            if "heartbeat=" not in one:
                params.heartbeat = max(1, round(heartbeat))
            params.tcp_options = dict(_TCP_OPTIONS)
            self._params.append(params)
        self.flow_control = FlowControl(self.description)
        self.publishers = _PublisherPool(self, publisher_connections, publisher_checkout_timeout)

    @property
    def description(self) -> str:
        return ",".join(mask_url(u) for u in self._urls)

    def connect(self) -> pika.BlockingConnection:
        """A new connection; raise BrokerConnectionError if the broker cannot be reached, and
        BrokerAccessRefused (a BrokerConnectionError waiting will not cure) if it refuses the
        credentials or the virtual host."""
        try:
            # Several nodes: pika tries them in order, each once, and keeps the first that
            # answers; every new connection starts again from the first.
            connection = pika.BlockingConnection(
                self._params if len(self._params) > 1 else self._params[0]
            )
        except _REFUSALS as exc:
            raise BrokerAccessRefused(
                f"RabbitMQ at {self.description} refused the login: {exc!r}"
            ) from exc
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(
                f"cannot connect to RabbitMQ at {self.description}: {exc!r}"
            ) from exc
        # No property a sender sets can break a connection that reads messages: consumers,
        # the operator tools reading dead letters, and publishers reading returns.
        decode_leniently(connection)
        connection.add_on_connection_blocked_callback(self.flow_control.on_blocked)
        connection.add_on_connection_unblocked_callback(self.flow_control.on_unblocked)
        return connection

    def declare(self, topology: Topology) -> None:
        connection = self.connect()
        try:
            channel = connection.channel()
            declared: list[Exchange | Queue] = [*topology.exchanges, *topology.queues]
            for obj in declared:
                try:
                    declare_on(channel, obj)
                except pika.exceptions.ChannelClosedByBroker as exc:
                    what = f"{type(obj).__name__.lower()} {obj.name!r}"
                    if exc.reply_code == 406:  # PRECONDITION_FAILED: it exists otherwise
                        raise TopologyMismatch(
                            f"{what} conflicts with what the broker has or accepts: "
                            f"{exc.reply_text}"
                        ) from exc
                    raise BrokerError(f"declaring {what} failed: {exc.reply_text}") from exc
            for binding in topology.bindings:
                channel.queue_bind(binding.queue, binding.exchange, binding.routing_key)
        except CONNECTION_ERRORS as exc:
            raise BrokerError(f"declaring topology on {self.description} failed: {exc!r}") from exc
        finally:
            close_quietly(connection)

    def close(self) -> None:
        """Close the pooled publishing connections (each consumer owns its connection)."""
        self.publishers.close()

    def publisher(self) -> RabbitMQPublisher:
        """A publishing connection of the pool; `close` returns it (`_PublisherPool.checkout`)."""
        return self.publishers.checkout()

    def consumer(self, queue: str, *, prefetch: int) -> RabbitMQConsumer:
        return RabbitMQConsumer(self.connect(), queue, prefetch=prefetch)

    def operator(self) -> RabbitMQAdmin:
        """An operator session on one connection of its own (opened at first use)."""
        return RabbitMQAdmin(self.connect, self.description)

    def queue_depth(self, queue: str) -> int | None:
        with self.operator() as admin:
            info = admin.queue_info(queue)
        return None if info is None else info[0]

    def body_limit(self, size: int) -> int | None:
        """RabbitMQ's ``max_message_size`` if it refuses a body of `size` bytes, else None. AMQP
        does not announce it: this publishes `size` zero bytes, confirmed and not mandatory, to
        a routing key no queue has (the broker drops it), and reads the refusal if one comes."""
        connection = self.connect()
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            try:
                channel.basic_publish("", SIZE_PROBE_ROUTING_KEY, bytes(size))
            except pika.exceptions.ChannelClosedByBroker as exc:
                refusal = Refusal.of(exc.reply_code, exc.reply_text)
                if refusal.max_body is not None:
                    return refusal.max_body
                raise BrokerError(f"probing the message size limit: {refusal}") from exc
            return None
        except CONNECTION_ERRORS as exc:
            raise BrokerError(f"cannot probe the message size limit: {exc!r}") from exc
        finally:
            close_quietly(connection)


#: Where `RabbitMQBroker.body_limit` sends its probe: a queue name no service can have.
SIZE_PROBE_ROUTING_KEY = "outbox-inbox.size-probe"

_LONG_STRING = struct.Struct(">cI")
_INT32 = struct.Struct(">ci")
_FRAME_END = b"\xce"
_PERSISTENT = struct.pack("B", pika.DeliveryMode.Persistent.value)


def _short_string(value: str | bytes) -> bytes:
    data = value if isinstance(value, bytes) else value.encode()
    if len(data) > 255:
        raise pika.exceptions.ShortStringTooLong(data)
    return bytes((len(data),)) + data


def _field(name: str, value: str | int) -> bytes:
    """One entry of an AMQP field table with a str or a 32-bit int value, as pika encodes it."""
    if isinstance(value, str):
        data = value.encode()
        return _short_string(name) + _LONG_STRING.pack(b"S", len(data)) + data
    return _short_string(name) + _INT32.pack(b"I", value)


#: Entries each cache of `_PublishFrames` keeps before it starts over.
_CACHE_SIZE = 4096


class _PublishFrames:
    """The AMQP frames of a persistent, mandatory ``basic.publish`` on one channel: byte for
    byte what pika's ``Channel.basic_publish`` writes, built without pika's frame objects, so
    that a publisher can hand many messages to the socket in one write. The parts that repeat
    from message to message (the method frame of an exchange and routing key, short strings,
    header entries such as ``x-kind``) are encoded once and kept."""

    def __init__(self, channel_number: int, body_max: int) -> None:
        self._channel_number = channel_number
        self._body_max = body_max
        self._methods: dict[tuple[str, str], bytes] = {}
        self._shorts: dict[str | bytes, bytes] = {}
        self._fields: dict[tuple[str, str | int], bytes] = {}

    def _method(self, exchange: str, routing_key: str) -> bytes:
        method = self._methods.get((exchange, routing_key))
        if method is None:
            if len(self._methods) >= _CACHE_SIZE:
                self._methods.clear()
            publish = Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True)
            method = pika.frame.Method(self._channel_number, publish).marshal()
            self._methods[(exchange, routing_key)] = method
        return method

    def _short(self, value: str | bytes) -> bytes:
        """A short string that is likely to repeat (content type, type, app id)."""
        encoded = self._shorts.get(value)
        if encoded is None:
            if len(self._shorts) >= _CACHE_SIZE:
                self._shorts.clear()
            encoded = self._shorts[value] = _short_string(value)
        return encoded

    def _table(self, table: Mapping[str, Any]) -> bytes:
        """An AMQP field table, as `pika.data.encode_table` writes it."""
        pieces: list[bytes] = []
        fields = self._fields
        for name, value in table.items():
            kind = type(value)  # exactly str or int: not bool, nor pika's `long` marker
            if kind is str or (kind is int and -0x80000000 <= value <= 0x7FFFFFFF):
                encoded = fields.get((name, value))
                if encoded is None:
                    if len(fields) >= _CACHE_SIZE:
                        fields.clear()
                    encoded = fields[(name, value)] = _field(name, value)
                pieces.append(encoded)
            else:  # bool, larger ints, None, lists, tables, ...: pika's own encoding
                pieces.append(_short_string(name))
                pika.data.encode_value(pieces, value)
        data = b"".join(pieces)
        return struct.pack(">I", len(data)) + data

    def _properties(self, message: WireMessage) -> bytes:
        """The property flags and list of the message's properties, as pika encodes them."""
        flags = BasicProperties.FLAG_HEADERS | BasicProperties.FLAG_DELIVERY_MODE
        pieces: list[bytes] = []
        if message.content_type is not None:
            flags |= BasicProperties.FLAG_CONTENT_TYPE
            pieces.append(self._short(message.content_type))
        pieces.append(self._table(message.headers))
        pieces.append(_PERSISTENT)
        if message.priority is not None:
            flags |= BasicProperties.FLAG_PRIORITY
            pieces.append(struct.pack("B", message.priority))
        if message.correlation_id is not None:
            flags |= BasicProperties.FLAG_CORRELATION_ID
            pieces.append(_short_string(message.correlation_id))
        if message.message_id is not None:
            flags |= BasicProperties.FLAG_MESSAGE_ID
            pieces.append(_short_string(message.message_id))
        if message.timestamp is not None:
            flags |= BasicProperties.FLAG_TIMESTAMP
            pieces.append(struct.pack(">Q", message.timestamp))
        if message.type is not None:
            flags |= BasicProperties.FLAG_TYPE
            pieces.append(self._short(message.type))
        if message.app_id is not None:
            flags |= BasicProperties.FLAG_APP_ID
            pieces.append(self._short(message.app_id))
        return struct.pack(">H", flags) + b"".join(pieces)

    def encode(self, message: WireMessage) -> bytes:
        """The frames of `message`, as one bytes object."""
        channel = self._channel_number
        body = message.body
        size = len(body)
        header = CONTENT_HEADER.pack(BasicProperties.INDEX, 0, size) + self._properties(message)
        out = [self._method(message.exchange, message.routing_key)]
        out += (FRAME_HEADER.pack(2, channel, len(header)), header, _FRAME_END)
        if size <= self._body_max:  # the usual case, without the loop: one body frame or none
            if size:
                out += (FRAME_HEADER.pack(3, channel, size), body, _FRAME_END)
            return b"".join(out)
        for start in range(0, size, self._body_max):
            chunk = body[start : start + self._body_max]
            out += (FRAME_HEADER.pack(3, channel, len(chunk)), chunk, _FRAME_END)
        return b"".join(out)


class PublishingBatch:
    """Messages handed to `RabbitMQPublisher.start_batch`, on their way to an outcome each (`done`
    once every one has). Two messages of one ordering key are never in flight together, and once one
    fails the later ones of its key are SKIPPED. The messages are kept encoded (frames as bytes,
    with their ids and keys), not as `WireMessage` objects: a relay keeps several batches in flight,
    and thousands of long-lived small objects make full garbage collections frequent."""

    __slots__ = (
        "_failed_keys", "_frames", "_keys", "_keys_in_flight", "_message_ids", "_todo",
        "_unconfirmed", "_unsettled", "_waiting", "deadline", "outcomes",
    )  # fmt: skip

    def __init__(
        self, messages: Sequence[WireMessage], deadline: float, frames: _PublishFrames | None
    ) -> None:
        count = len(messages)
        self.outcomes: list[PublishOutcome | None] = [None] * count
        self.deadline = deadline
        self._message_ids = [m.message_id for m in messages]
        self._keys = [m.key for m in messages]
        self._frames = [frames.encode(m) for m in messages] if frames is not None else []
        self._todo: deque[int] = deque(range(count))
        self._unconfirmed: dict[int, int] = {}  # delivery tag -> index, in tag order
        self._keys_in_flight: set[str] = set()
        self._waiting: dict[str, deque[int]] = {}
        self._failed_keys: set[str] = set()
        self._unsettled = count

    @property
    def done(self) -> bool:
        return self._unsettled == 0

    def results(self) -> list[PublishOutcome]:
        """One outcome per message (SKIPPED for any never settled); call once `done`."""
        return [o or PublishOutcome.SKIPPED for o in self.outcomes]

    def _next(self) -> int | None:
        """The index of the next message that may be sent now, or None."""
        todo = self._todo
        while todo:
            index = todo.popleft()
            key = self._keys[index]
            if key is None:
                return index
            if key in self._failed_keys:
                self._set(index, PublishOutcome.SKIPPED)
                for later in self._waiting.pop(key, ()):
                    self._set(later, PublishOutcome.SKIPPED)
                continue
            if key in self._keys_in_flight:
                self._waiting.setdefault(key, deque()).append(index)
                continue
            self._keys_in_flight.add(key)
            return index
        return None

    def _set(self, index: int, outcome: PublishOutcome) -> None:
        if self.outcomes[index] is None:
            self._unsettled -= 1
        self.outcomes[index] = outcome

    def _settle(self, index: int, outcome: PublishOutcome) -> None:
        self._set(index, outcome)
        key = self._keys[index]
        if key is None:
            return
        self._keys_in_flight.discard(key)
        if outcome is not PublishOutcome.CONFIRMED and outcome is not PublishOutcome.RETURNED:
            self._failed_keys.add(key)
        queued = self._waiting.get(key)
        if queued:
            self._todo.appendleft(queued.popleft())

    def _abandon(self, outcome: PublishOutcome) -> None:
        """Settle every message still without an outcome as `outcome` (the channel is gone)."""
        for index, current in enumerate(self.outcomes):
            if current is None:
                self._set(index, outcome)
        self._todo.clear()
        self._waiting.clear()
        self._unconfirmed.clear()


#: Longest wait of one pump for confirms: a confirm ends it at once (`_on_confirm`).
_CONFIRM_WAIT = 0.05


class RabbitMQPublisher:
    """Publishes with a window of unconfirmed messages on one channel in confirm mode. pika's
    BlockingChannel waits for each confirm in turn, about a round trip per message; this class turns
    confirms on at the asynchronous channel underneath (`BlockingChannel._impl`) and pumps the
    connection itself, so up to `window` publishes are in flight at once. Besides the blocking
    `publish_batch`, `start_batch` hands a batch over and returns at once, and `pump` moves every
    started batch on; they share the window."""

    def __init__(
        self, connection: pika.BlockingConnection, pool: _PublisherPool | None = None
    ) -> None:
        self._connection = connection
        self._pool = pool  # the pool it belongs to, if any
        self._lent = False  # lent to a thread by the pool, until closed
        self.fresh = True  # a connection no caller has used yet (the relay asks the limit)
        self._broken = False
        self._refusal: Refusal | None = None
        self._confirms: deque[tuple[int, bool, bool]] = deque()  # (tag, multiple, ack)
        self._returned: set[str] = set()
        self._window = 1
        self._batches: deque[PublishingBatch] = deque()  # started and not yet done, in order
        # A nack was received: the channel is replaced before the next batch (see `_renew`).
        self._nacked = False
        try:
            self._open_channel()
        except BaseException:
            close_quietly(connection)
            raise

    def _open_channel(self) -> None:
        try:
            self._channel = self._connection.channel()
            self._impl = self._channel._impl
            self._frames = _PublishFrames(
                self._impl.channel_number, self._impl.connection._body_max_length
            )
            self._next_tag = 1
            selected: list[bool] = []
            self._impl.confirm_delivery(
                ack_nack_callback=self._on_confirm, callback=lambda _frame: selected.append(True)
            )
            self._impl.add_on_return_callback(self._on_return)
            deadline = time.monotonic() + 10
            while not selected:
                if time.monotonic() > deadline:
                    raise BrokerConnectionError("RabbitMQ did not enable publisher confirms")
                self._connection.process_data_events(time_limit=0.05)
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"cannot open a publishing channel: {exc!r}") from exc

    def _renew(self) -> None:
        """Publish on a new channel from now on, once the messages in flight are settled: after
        a nack the channel may be what refuses (RabbitMQ 3.10 after a quorum queue's leader
        died: docs/failures.md); a nack of the queue's own (full) is given on the new one alike."""
        while self._batches and not self._broken:
            self.pump(_CONFIRM_WAIT)
        if self._broken:
            return
        self._nacked = False
        self._confirms.clear()
        self._returned.clear()
        failures: tuple[type[BaseException], ...] = (BrokerConnectionError, *CONNECTION_ERRORS)
        try:
            self._channel.close()
            self._open_channel()
        except failures as exc:
            log.warning("replacing the publishing channel failed: %r", exc)
            self._broken = True
            return
        log.debug("publishing channel replaced after a nack")

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def refusal(self) -> Refusal | None:
        return self._refusal

    def idle(self) -> None:
        """Let pika send and check heartbeats; a dead connection makes `broken` true."""
        if self._broken:
            return
        try:
            self._connection.process_data_events(time_limit=0)
        except CONNECTION_ERRORS as exc:
            log.debug("publishing connection failed while idle: %r", exc)
            self._broken = True

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        self._confirms.append(
            (method.delivery_tag, bool(method.multiple), isinstance(method, Basic.Ack))
        )
        if len(self._confirms) == 1:
            # A confirm arrived: end the pump's wait now. The blocking connection returns early for
            # its own events only: a posted callback is one, the asynchronous channel's are not.
            self._connection.add_callback_threadsafe(lambda: None)

    def _on_return(self, _channel: Any, _method: Any, props: BasicProperties, _body: bytes) -> None:
        if props.message_id:
            self._returned.add(props.message_id)

    def publish_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> list[PublishOutcome]:
        batch = self.start_batch(messages, window=window, timeout=timeout)
        while not batch.done:
            self.pump(_CONFIRM_WAIT)
        return batch.results()

    def start_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> PublishingBatch:
        """Start publishing `messages` (see `Publisher.publish_batch`) and return at once; the
        batch times out `timeout` seconds from now. Call `pump` until the batch is `done`."""
        if window < 1:
            raise ConfigurationError("publish window must be at least 1")
        if self._nacked:
            self._renew()
        deadline = time.monotonic() + timeout
        try:
            batch = PublishingBatch(messages, deadline, None if self._broken else self._frames)
        except CONNECTION_ERRORS as exc:  # e.g. a property too long: pika raises the same
            log.warning("cannot encode a batch for publishing: %r", exc)
            self._broken = True
        if self._broken:
            batch = PublishingBatch(messages, deadline, None)
            batch._abandon(PublishOutcome.FAILED)
        elif not batch.done:
            self._window = window
            self._batches.append(batch)
            self.pump(0)
        return batch

    def pump(self, wait: float) -> None:
        """Send what the window allows, process broker traffic and settle confirmed messages,
        waiting up to `wait` seconds for confirms when nothing could be sent. A batch past its
        deadline unconfirmed breaks the publisher: late confirms would match the wrong messages."""
        if not self._batches:
            return
        try:
            sent = self._fill()
            if self._unconfirmed():
                now = time.monotonic()
                if any(batch.deadline < now for batch in self._batches):
                    self._break(PublishOutcome.TIMEOUT)
                    return
                # Flush what was written, then wait briefly for confirms.
                self._connection.process_data_events(time_limit=0 if sent else wait)
                if self._impl.is_closing or self._impl.is_closed:
                    # The broker closed the channel over a message (406: too large; 404: no
                    # such exchange): no confirm will come, so do not wait for the timeout.
                    reason = self._impl._closing_reason
                    if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
                        self._refusal = Refusal.of(reason.reply_code, reason.reply_text)
                        log.warning("publishing channel closed: %s", self._refusal)
                        self._break(PublishOutcome.REFUSED)
                    else:
                        log.warning("publishing channel closed: %r", reason)
                        self._break(PublishOutcome.FAILED)
                    return
                self._settle_confirms()
        except CONNECTION_ERRORS as exc:
            log.warning("publishing connection lost: %r", exc)
            self._break(PublishOutcome.FAILED, PublishOutcome.FAILED)
            return
        while self._batches and self._batches[0].done:
            self._batches.popleft()

    def _unconfirmed(self) -> int:
        return sum(len(batch._unconfirmed) for batch in self._batches)

    def _fill(self) -> bool:
        """Publish messages of the started batches, in order, while the window has room, in
        one write (pika writes three frames per message, each with its own system call)."""
        room = self._window - self._unconfirmed()
        if room <= 0:
            return False
        if not self._impl.is_open:
            raise pika.exceptions.ChannelWrongStateError("the publishing channel is not open")
        out: list[bytes] = []
        tag = self._next_tag
        for batch in self._batches:
            frames = batch._frames
            unconfirmed = batch._unconfirmed
            while room > 0:
                index = batch._next()
                if index is None:
                    break
                out.append(frames[index])
                unconfirmed[tag] = index
                tag += 1
                room -= 1
            if room <= 0:
                break
        self._next_tag = tag
        if not out:
            return False
        data = b"".join(out)
        connection = self._impl.connection
        connection._adapter_emit_data(data)
        connection.bytes_sent += len(data)  # as pika counts what it writes itself
        return True

    def _settle_confirms(self) -> None:
        returned = self._returned
        while self._confirms:
            tag, multiple, acked = self._confirms.popleft()
            for batch in self._batches:
                unconfirmed = batch._unconfirmed
                if multiple:
                    # Tags are handed out in increasing order and the dict keeps that order.
                    tags = list(itertools.takewhile(tag.__ge__, unconfirmed))
                else:
                    tags = [tag] if tag in unconfirmed else []
                for t in tags:
                    index = unconfirmed.pop(t)
                    if not acked:
                        batch._settle(index, PublishOutcome.NACKED)
                        self._nacked = True
                        continue
                    message_id = batch._message_ids[index]
                    if returned and message_id in returned:
                        returned.discard(message_id)
                        batch._settle(index, PublishOutcome.RETURNED)
                    else:
                        batch._settle(index, PublishOutcome.CONFIRMED)

    def _break(self, lost: PublishOutcome, unsent: PublishOutcome = PublishOutcome.SKIPPED) -> None:
        """Give up on this channel: unconfirmed messages are `lost`, unsent ones `unsent`."""
        self._broken = True
        for batch in self._batches:
            for index in batch._unconfirmed.values():
                batch._set(index, lost)
            batch._abandon(unsent)
        self._batches.clear()

    def close(self) -> None:
        """Give the connection back to its pool (`RabbitMQBroker.publisher`), or close it."""
        if self._pool is None:
            close_quietly(self._connection)
        elif self._lent:  # once: a second close must not give it back twice
            self._lent = False
            self._pool.checkin(self)


class _PublisherPool:
    """The publishing connections of one broker: at most `size` checked out at once, each with one
    channel in confirm mode, kept open when given back. A checkout lends a connection to one thread
    until `RabbitMQPublisher.close` (pika's rule); no consumer uses one, so flow control that blocks
    publishing never stalls consuming. A checkout waits `timeout` seconds for a connection to come
    back, then raises BrokerError (docs/failures.md, "The publisher pool is exhausted")."""

    def __init__(self, broker: RabbitMQBroker, size: int, timeout: float) -> None:
        self._broker, self.size, self._timeout = broker, size, timeout
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._free: list[RabbitMQPublisher] = []  # given back, open
        self._closed = False
        self.opened = 0  # connections opened
        self.exhausted = 0  # checkouts that timed out

    def checkout(self) -> RabbitMQPublisher:
        if not self._slots.acquire(timeout=self._timeout):
            self.exhausted += 1
            log.warning(
                "all %d publishing connections to RabbitMQ at %s stayed in use for %.1f s: "
                "the publish waits for the next attempt (publisher_connections)",
                self.size,
                self._broker.description,
                self._timeout,
            )
            raise BrokerError(
                f"publisher pool exhausted: {self.size} connections in use after {self._timeout} s"
            )
        try:
            while True:
                with self._lock:
                    publisher = self._free.pop() if self._free else None
                if publisher is None:
                    publisher = RabbitMQPublisher(self._broker.connect(), self)
                    self.opened += 1  # a count for tests and status; exactness not needed
                    break
                publisher.idle()  # heartbeats; a connection the broker closed is replaced
                if not publisher.broken:
                    break
                close_quietly(publisher._connection)
        except BaseException:
            self._slots.release()
            raise
        publisher._lent = True
        return publisher

    def checkin(self, publisher: RabbitMQPublisher) -> None:
        """Keep `publisher` for the next checkout, unless it broke or still has messages out."""
        with self._lock:
            kept = not (self._closed or publisher.broken or publisher._batches)
            if kept:
                self._free.append(publisher)
        if not kept:
            close_quietly(publisher._connection)
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for publisher in free:
            close_quietly(publisher._connection)


class RabbitMQConsumer:
    """Consumes one queue (``basic.consume`` into a buffer that `fetch` drains) with at most
    `prefetch` unacknowledged; acknowledges from the owning thread. A consumer the broker
    cancels (its queue was deleted, or the queue's node failed) makes `fetch` raise
    TopologyMissing naming the queue, as a queue that does not exist does."""

    def __init__(self, connection: pika.BlockingConnection, queue: str, *, prefetch: int) -> None:
        self._connection = connection
        self._queue = queue
        self._forward_channel: BlockingChannel | None = None
        self._buffer: deque[Delivery] = deque()
        self._consumer_tag: str | None = None
        self._cancelled = False
        try:
            self._channel = connection.channel()
            self._channel.basic_qos(prefetch_count=prefetch)
            self._channel.add_on_cancel_callback(lambda _frame: setattr(self, "_cancelled", True))
        except CONNECTION_ERRORS as exc:
            close_quietly(connection)
            raise BrokerConnectionError(f"cannot consume {queue!r}: {exc!r}") from exc

    def _on_message(
        self, _channel: Any, method: Basic.Deliver, props: BasicProperties, body: bytes
    ) -> None:
        message = wire_message(method, props, body)
        self._buffer.append(Delivery(message, int(method.delivery_tag), bool(method.redelivered)))

    def _pump(self, until: float) -> None:
        """Process broker traffic until a first delivery is buffered or `until` passes, then
        take in what has already arrived without waiting for more."""
        while not self._buffer:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            self._connection.process_data_events(time_limit=min(remaining, 0.05))
        buffered = -1
        while len(self._buffer) != buffered:
            buffered = len(self._buffer)
            self._connection.process_data_events(time_limit=0)

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        try:
            if not self._channel.is_open:
                raise BrokerConnectionError(f"the channel consuming {self._queue!r} is closed")
            if self._consumer_tag is None:
                self._consumer_tag = self._channel.basic_consume(self._queue, self._on_message)
            self._pump(time.monotonic() + wait)
            if not self._channel.is_open:
                # Closed by the broker meanwhile: buffered deliveries can no longer be acked.
                self._buffer.clear()
                raise BrokerConnectionError(f"the channel consuming {self._queue!r} was closed")
            if self._cancelled:  # what it holds goes back to the queue, if the queue still is
                self._buffer.clear()
                raise TopologyMissing(
                    f"RabbitMQ cancelled the consumer of queue {self._queue!r} (the queue was "
                    "deleted, or its node failed)"
                )
        except CONNECTION_ERRORS as exc:
            if isinstance(exc, pika.exceptions.ChannelClosedByBroker) and exc.reply_code == 404:
                raise TopologyMissing(
                    f"queue {self._queue!r} does not exist: declare the topology"
                ) from exc
            raise BrokerConnectionError(f"consuming {self._queue!r} failed: {exc!r}") from exc
        return [self._buffer.popleft() for _ in range(min(max_count, len(self._buffer)))]

    def ack_through(self, tag: int) -> None:
        self.ack(tag, multiple=True)

    def ack(self, tag: int, multiple: bool = False) -> None:
        try:
            self._channel.basic_ack(delivery_tag=tag, multiple=multiple)
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"ack failed: {exc!r}") from exc

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        message = delivery.message
        # The properties frame must fit in one frame: 12 bytes of it are not properties.
        limit = self._connection._impl._body_max_length - 12
        props = forward_properties(message, headers, max_size=limit)
        try:
            if self._forward_channel is None:
                self._forward_channel = self._connection.channel()
                self._forward_channel.confirm_delivery()
            self._forward_channel.basic_publish(
                exchange, routing_key, message.body, props, mandatory=True
            )
            self._channel.basic_ack(delivery_tag=delivery.tag, multiple=False)
        except pika.exceptions.UnroutableError as exc:
            raise TopologyMissing(
                f"cannot forward to {exchange or '(default)'}/{routing_key}: no queue; "
                "declare the topology"
            ) from exc
        except pika.exceptions.NackError as exc:
            raise BrokerError(f"the broker refused a forwarded message: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            # A channel error (a missing exchange) closes the forwarding channel: a new one next.
            self._forward_channel = None
            raise BrokerConnectionError(f"forwarding failed: {exc!r}") from exc

    def close(self) -> None:
        """Close the connection; never raises. Unacknowledged deliveries return to the queue."""
        self._buffer.clear()
        close_quietly(self._connection)


class FlowControl:
    """The broker's flow control (``connection.blocked``) on the connections of one broker:
    logged once per blocking with the broker's reason and once when it ends, with how long it
    lasted; counted (by the connection's thread; only read elsewhere)."""

    def __init__(self, description: str) -> None:
        self._description = description
        self._lock = threading.Lock()
        self._since: dict[int, float] = {}
        self.blocked = 0  # how many times a connection was blocked
        self.reason: str | None = None  # the reason of the last blocking

    def on_blocked(self, connection: Any, frame: Any) -> None:
        reason = getattr(getattr(frame, "method", None), "reason", None) or "no reason given"
        with self._lock:
            self.blocked += 1
            self.reason = str(reason)
            self._since[id(connection)] = time.monotonic()
        log.warning(
            "RabbitMQ at %s blocked a connection: %s; its publishes wait until it is unblocked",
            self._description,
            reason,
        )

    def on_unblocked(self, connection: Any, _frame: Any) -> None:
        with self._lock:
            since = self._since.pop(id(connection), None)
        lasted = f" after {time.monotonic() - since:.1f} s" if since is not None else ""
        log.info("RabbitMQ at %s unblocked a connection%s", self._description, lasted)
