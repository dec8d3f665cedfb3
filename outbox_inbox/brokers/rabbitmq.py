"""RabbitMQ through pika: one BlockingConnection per publisher or consumer, owned by one thread."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from ..broker import Delivery, PublishOutcome
from ..errors import BrokerConnectionError, BrokerError, ConfigurationError, TopologyMismatch
from ..logsafe import mask_url
from ..messages import H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY, WireMessage
from ..topology import Topology

log = logging.getLogger(__name__)

#: Errors that mean the connection or channel is gone.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (pika.exceptions.AMQPError, OSError)


def _parameters(url: str) -> pika.URLParameters:
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises several types for a bad URL
        raise ConfigurationError(f"invalid broker URL {mask_url(url)}: {exc}") from exc
    return params


def _properties(message: WireMessage) -> BasicProperties:
    return BasicProperties(
        message_id=message.message_id,
        type=message.type,
        correlation_id=message.correlation_id,
        content_type=message.content_type,
        timestamp=message.timestamp,
        priority=message.priority,
        app_id=message.app_id,
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=dict(message.headers),
    )


def wire_message(method: Basic.Deliver, props: BasicProperties, body: bytes) -> WireMessage:
    """A delivery from pika as the library's WireMessage."""
    return WireMessage(
        exchange=method.exchange,
        routing_key=method.routing_key,
        body=body,
        message_id=props.message_id or "",
        type=props.type,
        correlation_id=props.correlation_id,
        content_type=props.content_type,
        timestamp=props.timestamp,
        priority=props.priority,
        app_id=props.app_id,
        headers=dict(props.headers or {}),
    )


class RabbitMQBroker:
    """RabbitMQ at `url` (``amqp://user:password@host:port/vhost``)."""

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        self._url = url
        self._params = _parameters(url)
        self._params.socket_timeout = connect_timeout
        self._params.blocked_connection_timeout = 60
        self._params.connection_attempts = 1

    @property
    def description(self) -> str:
        return mask_url(self._url)

    def connect(self) -> pika.BlockingConnection:
        """A new connection; raise BrokerConnectionError if the broker cannot be reached."""
        try:
            return pika.BlockingConnection(self._params)
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(
                f"cannot connect to RabbitMQ at {self.description}: {exc!r}"
            ) from exc

    def declare(self, topology: Topology) -> None:
        connection = self.connect()
        try:
            channel = connection.channel()
            for exchange in topology.exchanges:
                try:
                    channel.exchange_declare(
                        exchange.name,
                        exchange.type,
                        durable=exchange.durable,
                        arguments=dict(exchange.arguments) or None,
                    )
                except pika.exceptions.ChannelClosedByBroker as exc:
                    raise _mismatch(f"exchange {exchange.name!r}", exc) from exc
            for queue in topology.queues:
                try:
                    channel.queue_declare(
                        queue.name, durable=queue.durable, arguments=dict(queue.arguments) or None
                    )
                except pika.exceptions.ChannelClosedByBroker as exc:
                    raise _mismatch(f"queue {queue.name!r}", exc) from exc
            for binding in topology.bindings:
                channel.queue_bind(binding.queue, binding.exchange, binding.routing_key)
        except CONNECTION_ERRORS as exc:
            raise BrokerError(f"declaring topology on {self.description} failed: {exc!r}") from exc
        finally:
            close_quietly(connection)

    def close(self) -> None:
        """Nothing to release: every publisher and consumer owns its connection."""

    def publisher(self) -> RabbitMQPublisher:
        return RabbitMQPublisher(self.connect())

    def consumer(self, queue: str, *, prefetch: int) -> RabbitMQConsumer:
        return RabbitMQConsumer(self.connect(), queue, prefetch=prefetch)

    def queue_depth(self, queue: str) -> int | None:
        """Messages ready in `queue`, or None if it does not exist."""
        connection = self.connect()
        try:
            channel = connection.channel()
            try:
                result = channel.queue_declare(queue, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code == 404:
                    return None
                raise
            return int(result.method.message_count)
        except CONNECTION_ERRORS as exc:
            raise BrokerError(f"cannot inspect queue {queue!r}: {exc!r}") from exc
        finally:
            close_quietly(connection)


class RabbitMQPublisher:
    """Publishes with a window of unconfirmed messages on one channel in confirm mode.

    pika's BlockingChannel waits for each confirm in turn when confirms are on, which caps a
    publisher near a round trip per message. This class switches confirm mode on at the
    channel implementation underneath (`BlockingChannel._impl`, the asynchronous pika Channel)
    and pumps the connection itself, so up to `window` publishes are in flight at once.
    """

    def __init__(self, connection: pika.BlockingConnection) -> None:
        self._connection = connection
        self._broken = False
        self._channel = connection.channel()
        self._impl = self._channel._impl
        self._confirms: deque[tuple[int, bool, bool]] = deque()  # (tag, multiple, ack)
        self._returned: set[str] = set()
        self._next_tag = 1
        selected: list[bool] = []
        try:
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
            close_quietly(connection)
            raise BrokerConnectionError(f"cannot open a publishing channel: {exc!r}") from exc

    @property
    def broken(self) -> bool:
        return self._broken

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        self._confirms.append(
            (method.delivery_tag, bool(method.multiple), isinstance(method, Basic.Ack))
        )

    def _on_return(self, _channel: Any, _method: Any, props: BasicProperties, _body: bytes) -> None:
        if props.message_id:
            self._returned.add(props.message_id)

    def publish_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> list[PublishOutcome]:
        if window < 1:
            raise ConfigurationError("publish window must be at least 1")
        outcomes: list[PublishOutcome | None] = [None] * len(messages)
        if self._broken:
            return [PublishOutcome.FAILED] * len(messages)
        todo: deque[int] = deque(range(len(messages)))
        in_flight: dict[int, int] = {}  # delivery tag -> message index
        keys_in_flight: set[str] = set()
        waiting: dict[str, deque[int]] = {}
        failed_keys: set[str] = set()
        deadline = time.monotonic() + timeout

        def settle(index: int, outcome: PublishOutcome) -> None:
            outcomes[index] = outcome
            key = messages[index].key
            if key is None:
                return
            keys_in_flight.discard(key)
            if outcome not in (PublishOutcome.CONFIRMED, PublishOutcome.RETURNED):
                failed_keys.add(key)
            queued = waiting.get(key)
            if queued:
                todo.appendleft(queued.popleft())

        try:
            while todo or in_flight:
                sent = False
                while todo and len(in_flight) < window:
                    index = todo.popleft()
                    message = messages[index]
                    key = message.key
                    if key is not None:
                        if key in failed_keys:
                            outcomes[index] = PublishOutcome.SKIPPED
                            for later in waiting.pop(key, ()):
                                outcomes[later] = PublishOutcome.SKIPPED
                            continue
                        if key in keys_in_flight:
                            waiting.setdefault(key, deque()).append(index)
                            continue
                        keys_in_flight.add(key)
                    self._impl.basic_publish(
                        message.exchange,
                        message.routing_key,
                        message.body,
                        properties=_properties(message),
                        mandatory=True,
                    )
                    in_flight[self._next_tag] = index
                    self._next_tag += 1
                    sent = True
                if not in_flight:
                    continue
                if time.monotonic() > deadline:
                    break
                # Flush what was written, then wait briefly for confirms.
                self._connection.process_data_events(time_limit=0 if sent else 0.002)
                if self._impl.is_closing or self._impl.is_closed:
                    # The broker closed the channel (e.g. 404: the exchange does not exist):
                    # no confirm will come, so do not wait for the timeout.
                    log.warning("publishing channel closed by the broker")
                    self._broken = True
                    break
                while self._confirms:
                    tag, multiple, acked = self._confirms.popleft()
                    tags = [t for t in in_flight if t <= tag] if multiple else [tag]
                    for t in tags:
                        index = in_flight.pop(t, -1)
                        if index < 0:
                            continue
                        if not acked:
                            settle(index, PublishOutcome.NACKED)
                        elif messages[index].message_id in self._returned:
                            self._returned.discard(messages[index].message_id)
                            settle(index, PublishOutcome.RETURNED)
                        else:
                            settle(index, PublishOutcome.CONFIRMED)
        except CONNECTION_ERRORS as exc:
            log.warning("publishing connection lost: %r", exc)
            self._broken = True
            return [o or PublishOutcome.FAILED for o in outcomes]

        if in_flight:
            # Late confirms would be matched against the wrong batch: start a fresh channel.
            lost = PublishOutcome.FAILED if self._broken else PublishOutcome.TIMEOUT
            self._broken = True
            for index in in_flight.values():
                outcomes[index] = lost
        for key_queue in waiting.values():
            for index in key_queue:
                outcomes[index] = outcomes[index] or PublishOutcome.SKIPPED
        return [o or PublishOutcome.SKIPPED for o in outcomes]

    def close(self) -> None:
        close_quietly(self._connection)


class RabbitMQConsumer:
    """Consumes one queue with a prefetch window; acknowledges from the owning thread.

    Deliveries are pushed by the broker (``basic.consume``) into a buffer that `fetch` drains;
    at most `prefetch` are unacknowledged at a time.
    """

    def __init__(self, connection: pika.BlockingConnection, queue: str, *, prefetch: int) -> None:
        self._connection = connection
        self._queue = queue
        self._forward_channel: BlockingChannel | None = None
        self._buffer: deque[Delivery] = deque()
        self._consumer_tag: str | None = None
        try:
            self._channel = connection.channel()
            self._channel.basic_qos(prefetch_count=prefetch)
        except CONNECTION_ERRORS as exc:
            close_quietly(connection)
            raise BrokerConnectionError(f"cannot consume {queue!r}: {exc!r}") from exc

    def _on_message(
        self, _channel: Any, method: Basic.Deliver, props: BasicProperties, body: bytes
    ) -> None:
        self._buffer.append(
            Delivery(
                wire_message(method, props, body),
                int(method.delivery_tag),
                bool(method.redelivered),
            )
        )

    def _pump(self, until: float, enough: int) -> None:
        """Process broker traffic until `enough` deliveries are buffered or `until` passes."""
        while len(self._buffer) < enough:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            self._connection.process_data_events(time_limit=min(remaining, 0.05))

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        try:
            if not self._channel.is_open:
                raise BrokerConnectionError(f"the channel consuming {self._queue!r} is closed")
            if self._consumer_tag is None:
                self._consumer_tag = self._channel.basic_consume(self._queue, self._on_message)
            # Up to `wait` for a first delivery, then up to `wait` more to fill the batch.
            self._pump(time.monotonic() + wait, 1)
            if self._buffer:
                self._pump(time.monotonic() + wait, max_count)
            if not self._channel.is_open:
                # Closed by the broker meanwhile: buffered deliveries can no longer be acked.
                self._buffer.clear()
                raise BrokerConnectionError(f"the channel consuming {self._queue!r} was closed")
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                raise BrokerError(
                    f"queue {self._queue!r} does not exist: declare the topology"
                ) from exc
            raise BrokerConnectionError(f"consuming {self._queue!r} failed: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"consuming {self._queue!r} failed: {exc!r}") from exc
        batch: list[Delivery] = []
        while self._buffer and len(batch) < max_count:
            batch.append(self._buffer.popleft())
        return batch

    def ack_through(self, tag: int) -> None:
        try:
            self._channel.basic_ack(delivery_tag=tag, multiple=True)
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"ack failed: {exc!r}") from exc

    def ack(self, tag: int) -> None:
        try:
            self._channel.basic_ack(delivery_tag=tag, multiple=False)
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"ack failed: {exc!r}") from exc

    def forward(
        self,
        delivery: Delivery,
        exchange: str,
        routing_key: str,
        headers: Mapping[str, Any],
    ) -> None:
        message = delivery.message
        merged = dict(message.headers)
        merged.setdefault(H_ORIGINAL_EXCHANGE, message.exchange)
        merged.setdefault(H_ORIGINAL_ROUTING_KEY, message.routing_key)
        merged.update(headers)
        props = BasicProperties(
            message_id=message.message_id or None,
            type=message.type,
            correlation_id=message.correlation_id,
            content_type=message.content_type,
            timestamp=message.timestamp,
            priority=message.priority,
            app_id=message.app_id,
            delivery_mode=pika.DeliveryMode.Persistent,
            headers=merged,
        )
        try:
            if self._forward_channel is None:
                self._forward_channel = self._connection.channel()
                self._forward_channel.confirm_delivery()
            self._forward_channel.basic_publish(
                exchange, routing_key, message.body, props, mandatory=True
            )
            self._channel.basic_ack(delivery_tag=delivery.tag, multiple=False)
        except pika.exceptions.UnroutableError as exc:
            raise BrokerError(
                f"cannot forward to {exchange or '(default)'}/{routing_key}: no queue; "
                "declare the topology"
            ) from exc
        except pika.exceptions.NackError as exc:
            raise BrokerError(f"the broker refused a forwarded message: {exc!r}") from exc
        except CONNECTION_ERRORS as exc:
            # A channel error (e.g. a missing exchange) closes the forwarding channel: open a
            # new one next time.
            self._forward_channel = None
            raise BrokerConnectionError(f"forwarding failed: {exc!r}") from exc

    def close(self) -> None:
        """Close the connection; never raises. Unacknowledged deliveries return to the queue."""
        self._buffer.clear()
        close_quietly(self._connection)


def _mismatch(what: str, exc: pika.exceptions.ChannelClosedByBroker) -> BrokerError:
    if exc.reply_code == 406:  # PRECONDITION_FAILED: it exists with other arguments
        return TopologyMismatch(
            f"{what} conflicts with what the broker has or accepts: {exc.reply_text}"
        )
    return BrokerError(f"declaring {what} failed: {exc.reply_text}")


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close `connection` if it is open; log, never raise, what closing a broken one raises."""
    try:
        if connection.is_open:
            connection.close()
    except Exception as exc:  # closing must not raise: the caller is already recovering
        log.debug("closing a broken connection: %r", exc)
