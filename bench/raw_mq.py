"""Raw RabbitMQ limits with pika alone: confirmed publishing (a, a') and consuming (b)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import pika
from pika.spec import Basic

from bench.context import Context
from bench.timing import BenchError, Figure, Timer
from bench.wire import ACK_EVERY, PREFETCH, WINDOW, pika_properties
from outbox_inbox.messages import WireMessage

SYNC_CONFIRM_SECONDS = 5.0  # (a') publishes one by one for at most this long


def raw_publish_window(
    params: pika.ConnectionParameters,
    exchange: str,
    routing_key: str,
    wires: Sequence[WireMessage],
    window: int,
    timeout: float,
) -> Timer:
    """(a) SelectConnection, confirm mode, up to `window` unconfirmed, refilled on each confirm."""
    publisher = _WindowPublisher(exchange, routing_key, wires, window, timeout)
    publisher.run(params)
    if publisher.error:
        raise BenchError(f"raw publish: {publisher.error}")
    if publisher.nacked:
        raise BenchError(f"raw publish: {publisher.nacked} nacks")
    return publisher.timer


class _WindowPublisher:
    """The callbacks of (a) on one SelectConnection: publish until `window` messages wait for
    their confirm, refill on each confirm, stop the clock when the last one is confirmed."""

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        wires: Sequence[WireMessage],
        window: int,
        timeout: float,
    ) -> None:
        self.exchange, self.routing_key = exchange, routing_key
        self.wires, self.n, self.window, self.timeout = wires, len(wires), window, timeout
        self.timer = Timer()
        self.sent = self.through = self.nacked = 0
        self.error: str | None = None
        self.done = False
        self.singles: set[int] = set()  # tags above `through` confirmed one by one
        self.channel: Any = None
        self.connection: Any = None

    def run(self, params: pika.ConnectionParameters) -> None:
        connection = self.connection = pika.SelectConnection(
            params,
            on_open_callback=self.on_open,
            on_open_error_callback=self.on_open_error,
            on_close_callback=self.on_close,
        )
        connection.ioloop.call_later(self.timeout, self.on_timeout)
        try:
            connection.ioloop.start()
        finally:
            if not connection.is_closed:
                with contextlib.suppress(Exception):
                    connection.close()
                    connection.ioloop.call_later(5, connection.ioloop.stop)
                    connection.ioloop.start()

    def confirmed(self) -> int:
        return self.through + len(self.singles)

    def pump(self) -> None:
        while self.sent < self.n and self.sent - self.confirmed() < self.window:
            wire = self.wires[self.sent]
            self.channel.basic_publish(
                self.exchange,
                self.routing_key,
                wire.body,
                properties=pika_properties(wire),
                mandatory=True,
            )
            self.sent += 1

    def on_confirm(self, frame: Any) -> None:
        method = frame.method
        if not isinstance(method, Basic.Ack):
            self.nacked += 1
        tag = int(method.delivery_tag)
        if method.multiple:
            if tag > self.through:
                self.through = tag
                for t in [t for t in self.singles if t <= tag]:
                    self.singles.discard(t)
        elif tag > self.through:
            self.singles.add(tag)
        while self.through + 1 in self.singles:
            self.singles.discard(self.through + 1)
            self.through += 1
        if self.confirmed() >= self.n:
            self.timer.stop()
            self.done = True
            self.connection.close()
        else:
            self.pump()

    def on_select_ok(self, _frame: Any) -> None:
        self.timer.start()
        self.pump()

    def on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(ack_nack_callback=self.on_confirm, callback=self.on_select_ok)

    def on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self.on_channel)

    def on_open_error(self, _conn: Any, error: Any) -> None:
        self.error = f"cannot connect: {error!r}"
        self.connection.ioloop.stop()

    def on_close(self, _conn: Any, reason: Any) -> None:
        if not self.done and self.error is None:
            self.error = f"connection closed: {reason!r}"
        self.connection.ioloop.stop()

    def on_timeout(self) -> None:
        self.error = (
            f"timeout after {self.timeout:.0f} s ({self.confirmed()} of {self.n} confirmed)"
        )
        self.connection.close()


def raw_publish_sync(
    params: pika.ConnectionParameters,
    exchange: str,
    routing_key: str,
    wires: Sequence[WireMessage],
    max_seconds: float,
) -> tuple[int, Timer]:
    """(a') BlockingChannel.confirm_delivery: every basic_publish waits for its own confirm."""
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        sent = 0
        with Timer() as timer:
            deadline = time.perf_counter() + max_seconds
            for wire in wires:
                channel.basic_publish(
                    exchange, routing_key, wire.body, pika_properties(wire), mandatory=True
                )
                sent += 1
                if time.perf_counter() > deadline:
                    break
        return sent, timer
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def raw_consume(params: pika.ConnectionParameters, queue: str, n: int, timeout: float) -> Timer:
    """(b) BlockingConnection + basic_consume callback, prefetch 500, a multiple-ack per 250."""
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=PREFETCH)
        received = 0

        def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
            nonlocal received
            if received >= n:
                return  # prefetched beyond this attempt: unacked, requeued when we close
            received += 1
            if received % ACK_EVERY == 0 or received == n:
                ch.basic_ack(method.delivery_tag, multiple=True)

        timer = Timer()
        timer.start()
        tag = channel.basic_consume(queue, on_message)
        deadline = time.monotonic() + timeout
        while received < n:
            if time.monotonic() > deadline:
                raise BenchError(f"raw consume: {received} of {n} after {timeout:.0f} s")
            connection.process_data_events(time_limit=0.5)
        timer.stop()
        channel.basic_cancel(tag)
        return timer
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def measure(ctx: Context) -> None:
    """(a), (a') and (b) on the raw exchange and queues."""
    assert ctx.params is not None
    params, n = ctx.params, ctx.n
    # (a) and (b) alternate, so each publishing attempt starts on an empty queue, as the
    # relay does in (e), and each consuming attempt finds exactly N messages waiting.
    a = Figure("a", "pika publish, confirms, window 500 (SelectConnection)", "raw")
    b = Figure("b", "pika consume + ack per 250, prefetch 500", "raw")
    best_a: tuple[float, Timer] | None = None
    best_b: tuple[float, Timer] | None = None
    for _ in range(ctx.raw_repeats):
        timer = raw_publish_window(
            params, ctx.raw_exchange, "raw.window", ctx.wires, WINDOW, ctx.timeout
        )
        a.samples.append(round(n / timer.seconds, 1))
        if best_a is None or timer.seconds < best_a[0]:
            best_a = (timer.seconds, timer)
        depth = ctx.queue_depth(ctx.raw_queue)
        if depth != n:
            raise BenchError(f"raw queue holds {depth} messages, expected {n}")
        timer = raw_consume(params, ctx.raw_queue, n, ctx.timeout)
        b.samples.append(round(n / timer.seconds, 1))
        if best_b is None or timer.seconds < best_b[0]:
            best_b = (timer.seconds, timer)
    assert best_a is not None and best_b is not None
    ctx.record(a.took(n, best_a[1]))
    sent, timer = raw_publish_sync(
        params, ctx.raw_exchange, "raw.sync", ctx.wires, SYNC_CONFIRM_SECONDS
    )
    ctx.purge(ctx.raw_sync_queue)
    ctx.record(
        Figure(
            "a'",
            "pika publish, BlockingChannel confirm per message",
            "raw",
            note=f"once, time-boxed to {SYNC_CONFIRM_SECONDS:.0f} s",
        ).took(sent, timer)
    )
    ctx.record(b.took(n, best_b[1]))
