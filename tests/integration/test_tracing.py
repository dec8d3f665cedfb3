"""OpenTelemetry: one trace from a request through the outbox, relay, receiver and handler of
another service and back; foreign trace headers; nothing done when no tracer is configured."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind

from helpers import make_service, publish_raw, rows, scalar, wait_until
from outbox_inbox import Message

pytestmark = pytest.mark.integration


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A tracer provider of the SDK that keeps every finished span in memory (not global)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _one(found: list[ReadableSpan], name: str, service: str) -> ReadableSpan:
    matching = [
        s
        for s in found
        if s.name == name and (s.attributes or {}).get("outbox_inbox.service") == service
    ]
    assert len(matching) == 1, (name, service, [(s.name, s.attributes) for s in found])
    return matching[0]


def _parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_request_command_reply_and_reply_handler_form_one_trace(
    db_url_factory: Callable[[], str],
    mq_url: str,
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    orders = make_service("orders", db_url_factory(), mq_url, tracer_provider=provider)
    billing = make_service("billing", db_url_factory(), mq_url, tracer_provider=provider)
    seen: dict[str, Any] = {}
    done = threading.Event()

    @billing.on_command("invoice.create")
    def create_invoice(message: Message, session: Any) -> None:
        billing.outbox.publish(session, "invoice.created", {"order": message.payload["order"]})

    @orders.on_event("billing.invoice.created")
    def invoice_created(message: Message, session: Any) -> None:
        seen["message"] = message
        seen["current"] = trace.get_current_span().get_span_context()
        done.set()

    orders.start()
    billing.start()
    try:
        with (
            provider.get_tracer("test").start_as_current_span(
                "POST /orders", kind=SpanKind.SERVER
            ) as request,
            orders.session() as session,
            session.begin(),
        ):
            command_id = orders.outbox.send(session, "billing", "invoice.create", {"order": 7})
        assert done.wait(30), "the reply was not handled"
    finally:
        orders.stop()
        billing.stop()
    provider.force_flush()
    found = list(exporter.get_finished_spans())
    root = request.get_span_context()

    create_command = _one(found, "create billing.invoice.create", "orders")
    send_command = _one(found, "send billing.invoice.create", "orders")
    receive_command = _one(found, "receive billing.invoice.create", "billing")
    process_command = _one(found, "process billing.invoice.create", "billing")
    create_reply = _one(found, "create billing.invoice.created", "billing")
    send_reply = _one(found, "send billing.invoice.created", "billing")
    receive_reply = _one(found, "receive billing.invoice.created", "orders")
    process_reply = _one(found, "process billing.invoice.created", "orders")
    chain = [
        create_command,
        send_command,
        receive_command,
        process_command,
        create_reply,
        send_reply,
        receive_reply,
        process_reply,
    ]
    assert {s.context.trace_id for s in chain} == {root.trace_id}
    assert _parent_of(create_command) == root.span_id
    for span in (send_command, receive_command, process_command):
        assert _parent_of(span) == create_command.context.span_id, span.name
    assert _parent_of(create_reply) == process_command.context.span_id  # the handler's span
    for span in (send_reply, receive_reply, process_reply):
        assert _parent_of(span) == create_reply.context.span_id, span.name
    # A's handler ran inside its process span.
    assert seen["current"].span_id == process_reply.context.span_id

    reply = seen["message"]
    assert reply.correlation_id == str(command_id)
    for span in chain:
        attributes = span.attributes or {}
        assert attributes["messaging.system"] == "rabbitmq"
        assert attributes["messaging.message.conversation_id"] == str(command_id)
    assert create_command.kind is SpanKind.PRODUCER
    assert process_command.kind is SpanKind.CONSUMER
    command_attributes = process_command.attributes or {}
    assert command_attributes["messaging.message.id"] == str(command_id)
    assert command_attributes["messaging.destination.name"] == "commands"
    assert command_attributes["messaging.rabbitmq.destination.routing_key"] == (
        "billing.invoice.create"
    )
    assert (process_reply.attributes or {})["messaging.message.id"] == str(reply.message_id)
    assert (send_reply.attributes or {})["outbox_inbox.outcome"] == "confirmed"
    # The W3C header travelled with the message: the one the handler got names the reply's
    # create span.
    assert reply.headers["traceparent"] == _traceparent(create_reply.context)
    orders.close()
    billing.close()


def test_foreign_trace_headers_are_continued_when_valid_and_ignored_when_not(
    db_url: str, mq_url: str, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    billing = make_service("billing", db_url, mq_url, tracer_provider=provider)
    handled: dict[str, SpanContext] = {}

    @billing.on_command("invoice.create")
    def create_invoice(message: Message, session: Any) -> None:
        handled[message.original_id] = trace.get_current_span().get_span_context()

    billing.declare_topology()
    trace_id, span_id = uuid.uuid4().int, uuid.uuid4().int >> 64
    sent: dict[str, Any] = {
        "valid": f"00-{trace_id:032x}-{span_id:016x}-01",
        "garbage": "00-not-a-trace-context",
        "number": 42,
        "all-zero": f"00-{0:032x}-{0:016x}-01",
    }
    for name, value in sent.items():
        publish_raw(
            mq_url,
            "commands",
            "billing.invoice.create",
            b"{}",
            message_id=name,
            headers={"traceparent": value, "tracestate": "vendor=1"},
        )
    billing.start()
    try:
        wait_until(lambda: len(handled) == len(sent), what="every message handled")
    finally:
        billing.stop()
    provider.force_flush()
    process = {
        (s.attributes or {})["messaging.message.id"]: s
        for s in exporter.get_finished_spans()
        if s.name == "process billing.invoice.create"
    }
    assert process["valid"].context.trace_id == trace_id
    assert _parent_of(process["valid"]) == span_id
    assert process["valid"].parent is not None and process["valid"].parent.is_remote
    for name in ("garbage", "number", "all-zero"):
        assert process[name].parent is None, name  # a new trace, and the message handled
        assert process[name].context.trace_id != trace_id
    assert scalar(
        db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'processed'"
    ) == len(sent)
    billing.close()


class _OpenTelemetryCalls:
    """Every function of the opentelemetry package called in this thread while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> _OpenTelemetryCalls:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_globals.get("__name__", "").startswith("opentelemetry"):
            self.calls.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")


def test_without_a_tracer_the_hot_paths_create_no_span_and_parse_no_header(
    db_url: str, mq_url: str
) -> None:
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider was set in this process")
    billing = make_service("billing", db_url, mq_url, relay_batch_size=10, worker_batch_size=10)
    ran: list[Message] = []
    billing.on_command("invoice.create")(lambda message, session: ran.append(message))
    billing.declare_topology()
    foreign = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    relay, receiver, worker = billing.relay(), billing.receiver(), billing.worker()
    consumer = billing.broker.consumer("billing.inbox", prefetch=50)
    conn = worker.connect()
    try:
        with _OpenTelemetryCalls() as calls:
            with billing.session() as session, session.begin():
                for n in range(5):
                    billing.outbox.send(session, "billing", "invoice.create", {"n": n})
            assert relay.relay_once() == 5
        publish_raw(
            mq_url,
            "commands",
            "billing.invoice.create",
            b"{}",
            message_id="foreign",
            headers={"traceparent": foreign},
        )
        with calls:
            stored = 0
            while stored < 6:
                batch = consumer.fetch(10, 0.5)
                receiver.store(consumer, batch)
                stored = receiver.stored
            assert worker.work_once(conn) == 6
    finally:
        conn.close()
        consumer.close()
    assert len(ran) == 6
    # A sender's trace header is kept (and passed on to the handler), only not read.
    assert [m.headers.get("traceparent") for m in ran if m.original_id == "foreign"] == [foreign]
    assert all("traceparent" not in m.headers for m in ran if m.original_id != "foreign")
    # One look at the global provider per write and batch, nothing else of OpenTelemetry.
    assert set(calls.calls) == {"opentelemetry.trace.get_tracer_provider"}, calls.calls
    assert len(calls.calls) <= 5 + 3 * 4, calls.calls
    unsent = rows(
        db_url, "SELECT headers FROM outbox_inbox.outbox_messages WHERE headers ? 'traceparent'"
    )
    assert unsent == []
    billing.close()
