"""The relay's own encoding of a publish is byte for byte what pika writes for it."""

from __future__ import annotations

from typing import Any

import pika
import pika.frame
from hypothesis import given, settings
from hypothesis import strategies as st
from pika.spec import Basic, BasicProperties

from outbox_inbox.brokers.rabbitmq import _PublishFrames
from outbox_inbox.messages import WireMessage

CHANNEL = 3


def _properties(message: WireMessage) -> BasicProperties:
    """The properties the relay publishes a message with, as pika's own objects."""
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


def pika_frames(message: WireMessage, body_max: int) -> bytes:
    """The frames pika's Channel.basic_publish writes: method, content header, body frames."""
    publish = Basic.Publish(
        exchange=message.exchange, routing_key=message.routing_key, mandatory=True
    )
    out = [
        pika.frame.Method(CHANNEL, publish).marshal(),
        pika.frame.Header(CHANNEL, len(message.body), _properties(message)).marshal(),
    ]
    for start in range(0, len(message.body), body_max):
        out.append(pika.frame.Body(CHANNEL, message.body[start : start + body_max]).marshal())
    return b"".join(out)


def library_frames(encoder: _PublishFrames, message: WireMessage) -> bytes:
    return encoder.encode(message)


short_text = st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255)
header_value: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(short_text, inner, max_size=3),
    max_leaves=6,
)
messages = st.builds(
    WireMessage,
    exchange=st.sampled_from(["commands", "events", ""]),
    routing_key=short_text,
    body=st.binary(max_size=300),
    message_id=short_text,
    type=st.none() | short_text,
    correlation_id=st.none() | short_text,
    content_type=st.none() | st.sampled_from(["application/json", "text/plain"]),
    timestamp=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    priority=st.none() | st.integers(min_value=0, max_value=255),
    app_id=st.none() | short_text,
    headers=st.dictionaries(short_text, header_value, max_size=5),
)


@settings(max_examples=300, deadline=None)
@given(message=messages, body_max=st.sampled_from([16, 64, 131_064]))
def test_publish_frames_equal_pikas_for_any_message(message: WireMessage, body_max: int) -> None:
    encoder = _PublishFrames(CHANNEL, body_max)
    expected = pika_frames(message, body_max)
    assert library_frames(encoder, message) == expected
    # The caches of repeating parts give the same bytes the second time.
    assert library_frames(encoder, message) == expected


def test_an_empty_body_has_no_body_frame_as_in_pika() -> None:
    message = WireMessage(exchange="events", routing_key="a.b.c", body=b"", message_id="m")
    assert library_frames(_PublishFrames(CHANNEL, 64), message) == pika_frames(message, 64)
