"""The `Operator` port on RabbitMQ over AMQP (`RabbitMQBroker.operator`): checking objects,
reading and moving messages, tailing. A `RabbitMQAdmin` owns one connection and is used from
one thread. pika errors are translated here, like in `rabbitmq`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from ..broker import DIFFERS, MISSING, PRESENT, Found, Operator, QueuedMessage
from ..errors import BrokerConnectionError, BrokerError
from ..messages import WireMessage
from ..topology import Exchange, Queue
from .amqp_connection import CONNECTION_ERRORS, close_quietly, declare_on, wire_message
from .amqp_fields import PROPERTIES, LenientProperties

log = logging.getLogger(__name__)

#: The routing key of `flow_control`'s probes on the default exchange: no queue has this name.
FLOW_CONTROL_PROBE = "outbox-inbox.flow-control-probe"


def _broker_error(what: str, exc: BaseException) -> BrokerError:
    if isinstance(exc, pika.exceptions.ChannelClosedByBroker):
        if exc.reply_code == 404:
            return BrokerError(f"{what}: {exc.reply_text}; run `outbox-inbox topology apply`")
        return BrokerError(f"{what}: {exc.reply_text}")
    return BrokerConnectionError(f"{what}: {exc!r}")


class RabbitMQAdmin(Operator):
    """One connection to RabbitMQ for checks and operator actions. Close it (or use `with`).
    `connect` opens a new connection (raising BrokerConnectionError when it cannot); `description`
    names the broker, password masked (`RabbitMQBroker.operator` passes both)."""

    def __init__(self, connect: Callable[[], pika.BlockingConnection], description: str) -> None:
        self._connect, self._description = connect, description
        self._connection: pika.BlockingConnection | None = None

    @property
    def description(self) -> str:
        return self._description

    def _channel(self) -> BlockingChannel:
        """A new channel: the broker closes a channel on every refused operation."""
        if self._connection is None or not self._connection.is_open:
            self._connection = self._connect()
        try:
            return self._connection.channel()
        except CONNECTION_ERRORS as exc:
            raise BrokerConnectionError(f"cannot open a channel: {exc!r}") from exc

    def close(self) -> None:
        if self._connection is not None:
            close_quietly(self._connection)
            self._connection = None

    def flow_control(self, timeout: float = 1.0) -> str | None:
        """RabbitMQ blocks a connection only once it publishes, and then reads nothing more from
        it. So this publishes, on a connection of its own, a dropped empty message, then a
        mandatory one the broker returns (no route) only if it read on. None when that return
        comes first, or nothing within `timeout` seconds; else ``connection.blocked``'s reason.
        Raises BrokerConnectionError if the broker cannot be reached."""
        connection = self._connect()
        blocked: list[str] = []
        returned: list[bool] = []
        connection.add_on_connection_blocked_callback(
            lambda _conn, frame: blocked.append(str(getattr(frame.method, "reason", "")))
        )
        try:
            channel = connection.channel()
            channel.add_on_return_callback(lambda *_: returned.append(True))
            channel.basic_publish("", FLOW_CONTROL_PROBE, b"")
            channel.basic_publish("", FLOW_CONTROL_PROBE, b"", mandatory=True)
            deadline = time.monotonic() + timeout
            while not blocked and not returned and time.monotonic() < deadline:
                connection.process_data_events(time_limit=0.05)
        except CONNECTION_ERRORS as exc:
            raise _broker_error("probing flow control", exc) from exc
        finally:
            close_quietly(connection)
        return (blocked[0] or "blocked") if blocked else None

    def _on_channel(
        self,
        what: str,
        action: Callable[[BlockingChannel], Any],
        answers: Mapping[int, Callable[[pika.exceptions.ChannelClosedByBroker], Any]],
    ) -> Any:
        """What `action` returns on a new channel, or what `answers` gives for the reply code
        the broker closed the channel with; any other failure raises BrokerError."""
        channel = self._channel()
        try:
            result = action(channel)
        except CONNECTION_ERRORS as exc:
            if isinstance(exc, pika.exceptions.ChannelClosedByBroker) and exc.reply_code in answers:
                return answers[exc.reply_code](exc)
            raise _broker_error(what, exc) from exc
        _close_channel(channel)
        return result

    def _check(self, declared: Exchange | Queue) -> Found:
        """Passive declare tells existence; a declare with the expected arguments succeeds
        exactly when the broker holds the object with those arguments (else 406)."""
        what = f"checking {type(declared).__name__.lower()} {declared.name!r}"
        passive = self._on_channel(
            what, lambda ch: declare_on(ch, declared, passive=True), _NOT_FOUND
        )
        if passive is None:
            return Found(MISSING)
        # 406 PRECONDITION_FAILED: it exists with other arguments.
        differs = {406: lambda exc: Found(DIFFERS, str(exc.reply_text))}
        found = self._on_channel(what, lambda ch: declare_on(ch, declared), differs)
        return found if isinstance(found, Found) else Found(PRESENT)

    def check_exchange(self, exchange: Exchange) -> Found:
        return self._check(exchange)

    def check_queue(self, queue: Queue) -> Found:
        return self._check(queue)

    def queue_info(self, name: str) -> tuple[int, int] | None:
        result = self._on_channel(
            f"inspecting queue {name!r}",
            lambda ch: ch.queue_declare(name, passive=True),
            _NOT_FOUND,
        )
        if result is None:
            return None
        return int(result.method.message_count), int(result.method.consumer_count)

    def purge_queue(self, name: str) -> int:
        result = self._on_channel(
            f"purging queue {name!r}", lambda ch: ch.queue_purge(name), _NOT_FOUND
        )
        return 0 if result is None else int(result.method.message_count)

    def delete_queue(self, name: str) -> int:
        result = self._on_channel(f"deleting queue {name!r}", lambda ch: ch.queue_delete(name), {})
        return int(result.method.message_count)

    def reader(self, queue: str) -> QueueReader:
        """A reader of `queue` on a channel of its own. Raises BrokerError if it is missing."""
        return QueueReader(self._channel(), self._channel(), queue)

    def tail(
        self,
        exchange: str,
        patterns: list[str],
        *,
        on_ready: Callable[[str], None],
        on_message: Callable[[WireMessage], bool],
        should_stop: Callable[[], bool],
    ) -> None:
        """The private queue is server-named, exclusive and auto-delete: the broker deletes it
        when this connection closes, however the process ends."""
        channel = self._channel()
        try:
            declared = channel.queue_declare("", exclusive=True, auto_delete=True)
            name = str(declared.method.queue)
            for pattern in patterns:
                channel.queue_bind(name, exchange, pattern)
        except CONNECTION_ERRORS as exc:
            raise _broker_error(f"binding a tail queue to exchange {exchange!r}", exc) from exc
        on_ready(name)
        try:
            for method, props, body in channel.consume(name, auto_ack=True, inactivity_timeout=0.2):
                if should_stop() or (
                    method is not None and not on_message(wire_message(method, props, body))
                ):
                    break
        except CONNECTION_ERRORS as exc:
            raise _broker_error(f"consuming the tail queue {name}", exc) from exc


class QueueReader:
    """The `QueueReader` protocol on a channel; taken messages return when it closes.
    Republishing uses a second channel in confirm mode."""

    def __init__(self, channel: BlockingChannel, publish_channel: BlockingChannel, queue: str):
        self._channel = channel
        self._publish = publish_channel
        self._queue = queue
        self._confirming = False

    @property
    def queue(self) -> str:
        return self._queue

    def depth(self) -> int:
        try:
            result = self._publish.queue_declare(self._queue, passive=True)
        except CONNECTION_ERRORS as exc:
            raise _broker_error(f"reading queue {self._queue!r}", exc) from exc
        return int(result.method.message_count)

    def get(self) -> QueuedMessage | None:
        try:
            method, props, body = self._channel.basic_get(self._queue, auto_ack=False)
        except CONNECTION_ERRORS as exc:
            raise _broker_error(f"reading queue {self._queue!r}", exc) from exc
        if method is None:
            return None
        message = wire_message(method, props, body)
        return QueuedMessage(method.delivery_tag, message, bool(method.redelivered), props)

    def ack(self, message: QueuedMessage) -> None:
        try:
            self._channel.basic_ack(delivery_tag=message.tag, multiple=False)
        except CONNECTION_ERRORS as exc:
            raise _broker_error(f"acknowledging a message of {self._queue!r}", exc) from exc

    def republish(
        self, message: QueuedMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> bool:
        # Lenient: what a lenient connection read (floats, raw fields) encodes back unchanged.
        properties = LenientProperties(
            **{name: getattr(message.properties, name) for name in _REPUBLISHED},
            headers=dict(headers),
            delivery_mode=pika.DeliveryMode.Persistent,
        )
        try:
            if not self._confirming:
                self._publish.confirm_delivery()
                self._confirming = True
            self._publish.basic_publish(
                exchange, routing_key, message.message.body, properties, mandatory=True
            )
        except pika.exceptions.UnroutableError:
            return False
        except pika.exceptions.NackError as exc:
            raise BrokerError(f"the broker refused the copy sent to {exchange!r}") from exc
        except CONNECTION_ERRORS as exc:
            raise _broker_error(
                f"republishing to exchange {exchange or '(default)'!r} / {routing_key!r}", exc
            ) from exc
        return True

    def close(self) -> None:
        _close_channel(self._channel)
        _close_channel(self._publish)


#: The properties a republished copy keeps, besides its headers. user_id is left out: the
#: broker refuses it unless it names this connection's user.
_REPUBLISHED = [
    p[0] for p in PROPERTIES if p[0] not in ("headers", "delivery_mode", "user_id", "cluster_id")
]

#: `RabbitMQAdmin._on_channel`'s answer to 404 NOT_FOUND: None (no such object).
_NOT_FOUND = {404: lambda _exc: None}


def _close_channel(channel: BlockingChannel) -> None:
    try:
        if channel.is_open:
            channel.close()
    except Exception as exc:  # closing must not raise: the connection may already be gone
        log.debug("closing a channel: %r", exc)
