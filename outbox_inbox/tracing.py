"""OpenTelemetry spans of a service's messages, and their W3C trace context on the wire: the spans,
their attributes and how the context travels are in docs/observability.md ("Traces"). A missing or
invalid trace header only means a new trace; a tracing error is logged and never fails a message."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .broker import PublishOutcome
from .messages import (
    COMMAND,
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    H_ORIGINAL_ID,
    Message,
    OutgoingMessage,
)

log = logging.getLogger(__name__)

#: The W3C Trace Context header names, in the outbox row's headers and on the wire.
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SYSTEM = "rabbitmq"
INSTRUMENTATION = "outbox_inbox"

# Attribute names of the OpenTelemetry semantic conventions for messaging.
A_SYSTEM = "messaging.system"
A_OPERATION_TYPE = "messaging.operation.type"
A_OPERATION_NAME = "messaging.operation.name"
A_DESTINATION = "messaging.destination.name"
A_ROUTING_KEY = "messaging.rabbitmq.destination.routing_key"
A_MESSAGE_ID = "messaging.message.id"
A_CONVERSATION_ID = "messaging.message.conversation_id"
A_CONSUMER_GROUP = "messaging.consumer.group.name"
A_SUBSCRIPTION = "messaging.destination.subscription.name"
# This library's own.
A_SERVICE = "outbox_inbox.service"
A_KIND = "outbox_inbox.kind"
A_ATTEMPT = "outbox_inbox.attempt"
A_OUTCOME = "outbox_inbox.outcome"
A_DUPLICATE = "outbox_inbox.duplicate"

_PROPAGATOR = TraceContextTextMapPropagator()
_NOTHING: AbstractContextManager[None] = nullcontext()


class _HeaderGetter(Getter[Mapping[str, Any]]):
    """Reads trace headers from message headers: text values only (a foreign sender's number
    or table under these names is ignored, as an invalid value is)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [k for k in carrier if isinstance(k, str)]


_GETTER = _HeaderGetter()


class Tracing:
    """Where a service's spans go: `provider`, else the global tracer provider once one is set.
    Thread-safe. `tracer()` is None while spans would go nowhere (no provider, or a no-op one)."""

    def __init__(self, service: str, provider: TracerProvider | None = None) -> None:
        self.service, self.provider = service, provider
        self._tracer: Tracer | None = None

    def tracer(self) -> Tracer | None:
        """The tracer to use now, or None when tracing is off (the cheap check of hot paths)."""
        if self._tracer is not None:
            return self._tracer
        provider = self.provider if self.provider is not None else trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None  # the API's defaults: nothing is recorded anywhere
        # A global provider, once set, cannot be unset: the tracer is kept.
        self._tracer = provider.get_tracer(INSTRUMENTATION)
        return self._tracer


def extract(headers: Mapping[str, Any]) -> Context:
    """The trace context that `headers` carry; an empty one if they carry none or an invalid
    one (the span started from it is then the root of a new trace)."""
    if TRACEPARENT not in headers:
        return Context()
    try:
        return _PROPAGATOR.extract(headers, Context(), getter=_GETTER)
    except Exception:  # a foreign value the propagator chokes on: a new trace, not a failure
        log.debug("tracing: ignoring an unreadable trace context", exc_info=True)
        return Context()


def creating(tracing: Tracing, row: dict[str, Any]) -> AbstractContextManager[None]:
    """The ``create`` span of an outbox row being written, a child of the current span, its
    context put into ``row["headers"]`` before the block runs. Nothing when tracing is off."""
    tracer = tracing.tracer()
    return _NOTHING if tracer is None else _creating(tracer, tracing.service, row)


@contextmanager
def _creating(tracer: Tracer, service: str, row: dict[str, Any]) -> Iterator[None]:
    attributes = {
        **_common("create", row["exchange"], row["routing_key"], str(row["message_id"])),
        A_CONVERSATION_ID: row.get("correlation_id") or "",
        A_KIND: row["kind"],
        A_SERVICE: service,
    }
    with tracer.start_as_current_span(
        f"create {row['routing_key']}", kind=SpanKind.PRODUCER, attributes=attributes
    ) as span:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
        row["headers"] = {**row["headers"], **carrier}
        yield


def processing(
    tracer: Tracer | None, service: str, message: Message
) -> AbstractContextManager[Any]:
    """The ``process`` span of a message whose handlers run in the block (the current span,
    so what they write to the outbox continues the trace). Nothing when `tracer` is None."""
    if tracer is None:
        return _NOTHING
    # record_exception / set_status_on_exception: a handler's error (Retry and Reject too)
    # marks the span, and propagates unchanged.
    return tracer.start_as_current_span(**_process(service, message))


def processing_batch(
    tracer: Tracer | None, service: str, messages: Sequence[Message]
) -> AbstractContextManager[list[Span]]:
    """The ``process`` spans of messages whose batch handler runs in the block, one per
    message as in `processing`; none is current (give one to `current` where the handler
    works for its message). Yields [] when `tracer` is None."""
    if tracer is None:
        return nullcontext([])
    return _processing_batch(tracer, service, messages)


@contextmanager
def _processing_batch(
    tracer: Tracer, service: str, messages: Sequence[Message]
) -> Iterator[list[Span]]:
    spans = [tracer.start_span(**_process(service, m)) for m in messages]
    try:
        yield spans
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        for span in spans:
            span.end()


def current(span: Span | None) -> AbstractContextManager[Any]:
    """Make `span` the current span in the block (nothing when it is None)."""
    return _NOTHING if span is None else trace.use_span(span, end_on_exit=False)


def _process(service: str, message: Message) -> dict[str, Any]:
    """The arguments of a message's ``process`` span."""
    attributes = {
        **_common("process", _exchange(message.kind), message.type, message.original_id),
        A_CONVERSATION_ID: message.correlation_id or "",
        A_KIND: message.kind,
        A_ATTEMPT: message.attempt,
    }
    if service:  # a Worker built without a Service does not know its service's name
        attributes |= _consumer(service)
    span = {"name": f"process {message.type}", "kind": SpanKind.CONSUMER}
    return {**span, "context": extract(message.headers), "attributes": attributes}


def record_sends(
    tracer: Tracer,
    service: str,
    messages: Sequence[OutgoingMessage],
    outcomes: Sequence[PublishOutcome],
    started_ns: int,
) -> None:
    """One ``send`` span per message of a relay batch, from `started_ns` (when the batch went
    out) to now, each a child of its message's ``create`` span, with the broker's outcome."""
    if not messages:
        return
    try:
        end = time.time_ns()
        for message, outcome in zip(messages, outcomes, strict=True):
            ok = outcome is PublishOutcome.CONFIRMED or (
                outcome is PublishOutcome.RETURNED and message.kind != COMMAND
            )
            message_id = str(message.message_id)
            span = tracer.start_span(
                f"send {message.routing_key}",
                context=extract(message.headers),
                kind=SpanKind.CLIENT,
                start_time=started_ns,
                attributes={
                    **_common("send", message.exchange, message.routing_key, message_id),
                    A_OPERATION_NAME: "publish",
                    A_CONVERSATION_ID: message.correlation_id or "",
                    A_KIND: message.kind,
                    A_ATTEMPT: message.attempt,
                    A_OUTCOME: outcome.value,
                    A_SERVICE: service,
                },
            )
            if not ok and outcome is not PublishOutcome.SKIPPED:
                span.set_status(Status(StatusCode.ERROR, f"publish {outcome.value}"))
            span.end(end_time=end)
    except Exception:
        log.warning("tracing: recording the relay's spans failed", exc_info=True)


def record_receives(
    tracer: Tracer, service: str, rows: Sequence[tuple[Mapping[str, Any], bool]], started_ns: int
) -> None:
    """One ``receive`` span per stored delivery (row values, and whether it was a duplicate),
    from `started_ns` (when the batch's insert began) to now (after its commit)."""
    try:
        end = time.time_ns()
        for row, duplicate in rows:
            headers = row["headers"]
            original = headers.get(H_ORIGINAL_ID)
            message_id = original if isinstance(original, str) else str(row["message_id"])
            span = tracer.start_span(
                f"receive {row['routing_key']}",
                context=extract(headers),
                kind=SpanKind.CLIENT,
                start_time=started_ns,
                attributes={
                    **_common("receive", _exchange(row["kind"]), row["routing_key"], message_id),
                    A_CONVERSATION_ID: row.get("correlation_id") or "",
                    **_consumer(service),
                    A_KIND: row["kind"],
                    A_DUPLICATE: duplicate,
                },
            )
            span.end(end_time=end)
    except Exception:
        log.warning("tracing: recording the receiver's spans failed", exc_info=True)


def _common(operation: str, exchange: str, routing_key: str, message_id: str) -> dict[str, Any]:
    return {
        A_SYSTEM: SYSTEM,
        A_OPERATION_TYPE: operation,
        A_OPERATION_NAME: operation,
        A_DESTINATION: exchange,
        A_ROUTING_KEY: routing_key,
        A_MESSAGE_ID: message_id,
    }


def _consumer(service: str) -> dict[str, Any]:
    return {A_CONSUMER_GROUP: service, A_SUBSCRIPTION: f"{service}.inbox", A_SERVICE: service}


def _exchange(kind: str) -> str:
    """The exchange a message of `kind` travels through."""
    return COMMANDS_EXCHANGE if kind == COMMAND else EVENTS_EXCHANGE
