"""What the RabbitMQ broker and its operator session both need of pika: the errors of a lost
connection, closing one without hanging, declaring an exchange or queue, a delivery's message."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from ..messages import WireMessage
from ..topology import Exchange, Queue
from .amqp_fields import kept_properties

log = logging.getLogger(__name__)

#: Errors that mean the connection or channel is gone.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (pika.exceptions.AMQPError, OSError)


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
        properties=kept_properties(props),
    )


def declare_on(channel: BlockingChannel, obj: Exchange | Queue, *, passive: bool = False) -> Any:
    """Declare `obj` on `channel` as the topology says; `passive`: only ask that it exists."""
    arguments = dict(obj.arguments) or None
    if isinstance(obj, Exchange):
        return channel.exchange_declare(
            obj.name, obj.type, passive=passive, durable=obj.durable, arguments=arguments
        )
    return channel.queue_declare(
        obj.name, passive=passive, durable=obj.durable, arguments=arguments
    )


#: How long a close may wait for the broker's answer before the connection is abandoned.
CLOSE_TIMEOUT = 2.0


def close_quietly(connection: pika.BlockingConnection, timeout: float = CLOSE_TIMEOUT) -> None:
    """Close `connection` if it is open, waiting `timeout` seconds at most; never raise. A polite
    close waits for the broker's close-ok, which a blocked connection (memory alarm) or a dead link
    (blackhole) never sends: pika would wait for its blocked or heartbeat timeout. So the close runs
    in a thread of its own, which owns the connection from then on, and the caller moves on after
    `timeout`; that thread ends when pika gives up."""
    if not connection.is_open:
        return

    def close() -> None:
        try:
            connection.close()
        except Exception as exc:  # closing must not raise: the caller is already recovering
            log.debug("closing a broken connection: %r", exc)

    closer = threading.Thread(target=close, name="outbox-inbox-amqp-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        log.debug("RabbitMQ did not answer the close within %.1f s; connection abandoned", timeout)
