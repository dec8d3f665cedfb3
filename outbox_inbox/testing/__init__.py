"""Test helpers: run a service's handlers in a test, in memory or on real servers. A
`ServiceHarness` drives one `Service` one step at a time in the calling thread, through the code
paths the real roles run. The pytest fixtures at the end of this module (entry point ``pytest11``)
and the switch to real servers are described in docs/testing.md."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select, update

from ..broker import Broker, Consumer, PublishOutcome
from ..brokers.memory import MemoryBroker
from ..errors import ConfigurationError, OutboxInboxError
from ..messages import (
    COMMAND,
    COMMANDS_EXCHANGE,
    EVENT,
    EVENTS_EXCHANGE,
    OutgoingMessage,
    check_headers,
    from_row,
    inbox_id,
    to_wire,
)
from ..service import Service
from ..tables import DEAD, PENDING, PROCESSED, Tables, outbox_unsent
from ..topology import dead_letter_queue, delay_queue, inbox_queue, topic_matches

__all__ = [
    "HarnessTimeout", "InboxRow", "NotDelivered", "PublishedMessage", "ServiceHarness",
    "run_all_until_idle",
]  # fmt: skip

#: How long `run_until_idle` waits by default before it gives up (seconds).
DEFAULT_TIMEOUT = 10.0
#: On a real broker: how long one receive waits for deliveries on their way, and how long
#: `deliver` waits for its message to reach the inbox queue.
RECEIVE_WAIT = 0.05
DELIVERY_WAIT = 10.0


class NotDelivered(OutboxInboxError, AssertionError):
    """A message given to `ServiceHarness.deliver` did not reach the service's inbox."""


class HarnessTimeout(OutboxInboxError, AssertionError):
    """The services did not become idle in time (a handler keeps producing work?)."""


@dataclass(frozen=True)
class PublishedMessage:
    """A message the service wrote to its outbox: an event it published or a command it sent.
    `type` is the routing key; `sent` is True once the relay has published it to the broker."""

    message_id: uuid.UUID
    kind: str
    type: str
    payload: Any
    key: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    priority: int | None = None
    version: int = 1
    sent: bool = False


@dataclass(frozen=True)
class InboxRow:
    """A message in the service's inbox and what became of it: `status` is ``pending``,
    ``processed`` or ``dead``; `attempts` counts the times a worker took it, `last_error` holds the
    last handler failure (a traceback) and `dead_reason` why it is dead (``max_attempts``,
    ``rejected``, ``no_handler``, ``expired``, ``abandoned``, …)."""

    message_id: uuid.UUID
    kind: str
    type: str
    payload: Any
    status: str
    attempts: int
    last_error: str | None = None
    dead_reason: str | None = None
    key: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


class ServiceHarness:
    """Drives one `Service` on a `MemoryBroker` (or RabbitMQ) step by step, in the calling thread.
    Declares the service's topology and, unless ``migrate=False``, migrates its database (its
    business tables are the caller's). Raises ConfigurationError for the process's shared in-memory
    broker, and on RabbitMQ for a running service's queues (docs/testing.md); it never purges a
    queue. Not thread-safe; the service must not be started. `close()` leaves the service and the
    broker open."""

    def __init__(self, service: Service, *, migrate: bool = True) -> None:
        broker = service.broker
        if broker is MemoryBroker.shared():
            raise ConfigurationError(
                "ServiceHarness needs a service on a broker of its own, not the shared "
                "in-memory broker: build it with broker=MemoryBroker() (or the "
                "outbox_inbox_broker fixture)"
            )
        self.service = service
        self.broker: Broker = broker
        #: On a real broker messages take a moment to travel: receiving waits a little, and
        #: idle also means the inbox queue is empty.
        self.real = not isinstance(broker, MemoryBroker)
        #: The queues this harness declared (they did not exist): the only ones it deletes.
        self._owned = self._claim() if self.real else []
        if migrate:
            service.migrate()
        service.declare_topology()
        self._relay = service.relay()
        self._receiver = service.receiver()
        self._worker = service.worker(name=f"harness-{service.name}-{uuid.uuid4().hex[:6]}")
        self._consumer: Consumer | None = None
        self._closed = False

    def _claim(self) -> list[str]:
        """The service's queues on a real broker that do not exist yet; raises what the class
        docstring says of a running service's queues."""
        name = self.service.name
        queues = [inbox_queue(name), dead_letter_queue(name)]
        queues += [delay_queue(name, t) for t in self.service.settings.delay_tiers]
        with self.broker.operator() as admin:
            found = {queue: admin.queue_info(queue) for queue in queues}
        consumers = (found[queues[0]] or (0, 0))[1]
        held = [f"{q} ({info[0]})" for q, info in found.items() if info and info[0]]
        if consumers or held:
            why = f"{queues[0]} has a consumer" if consumers else f"{', '.join(held)} hold messages"
            raise ConfigurationError(
                f"{why} on {self.broker.description}: a running service {name} would share the"
                " test's messages; give the test a virtual host of its own (docs/testing.md)"
            )
        return [queue for queue, info in found.items() if info is None]

    def __repr__(self) -> str:
        return f"<ServiceHarness {self.service.name} on {self.broker.description}>"

    def __enter__(self) -> ServiceHarness:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop consuming the inbox queue. On a real broker, delete the queues the harness
        declared for the service (inbox, dead letters, delay tiers, with what is left in
        them: those that did not exist before it), so that a test leaves nothing on the
        broker; the exchanges, shared by every service, stay. Idempotent."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self.real and not self._closed:
            self._closed = True
            with self.broker.operator() as admin:
                for queue in self._owned:
                    admin.delete_queue(queue)

    def deliver(
        self,
        type: str,
        payload: Any,
        *,
        kind: str = COMMAND,
        key: str | None = None,
        headers: Mapping[str, Any] | None = None,
        message_id: uuid.UUID | str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        source: str | None = None,
        priority: int | None = None,
    ) -> uuid.UUID:
        """Send one message to this service through the broker and store it in its inbox; return the
        id the inbox keys it on. `type` is the full routing key; `kind` picks the ``commands`` or
        ``events`` exchange. The receiver stores it as in production (a stored `message_id` is
        dropped as a duplicate); handlers run at `run_until_idle`. `correlation_id` defaults to the
        message id; `source` names the sending service (None: a plain AMQP client, which gets no
        fault). Raises NotDelivered when the broker would not route the message here or the receiver
        did not store it; MessageError for a payload or headers that cannot be sent."""
        name = self.service.name
        self.service.declare_topology()  # picks up handlers registered since (idempotent)
        if kind == COMMAND:
            if not type.startswith(f"{name}."):
                raise NotDelivered(
                    f"command {type!r} is addressed to another service: {name} receives the "
                    f"commands {name}.*"
                )
            exchange = COMMANDS_EXCHANGE
        elif kind == EVENT:
            patterns = self.service.handlers.event_patterns()
            if not any(topic_matches(p, type) for p in patterns):
                raise NotDelivered(
                    f"{name} subscribes to no event {type!r} (its patterns: {sorted(patterns)}):"
                    " the broker would drop it"
                )
            exchange = EVENTS_EXCHANGE
        else:
            raise ConfigurationError(f"kind must be {COMMAND!r} or {EVENT!r}, not {kind!r}")
        wire_id = str(message_id) if message_id is not None else str(uuid.uuid4())
        stored_id = inbox_id(wire_id)
        wire = to_wire(
            OutgoingMessage(
                id=0,
                message_id=stored_id,
                kind=kind,
                exchange=exchange,
                routing_key=type,
                payload=payload,
                headers=check_headers(headers),
                source=source or "",
                correlation_id=correlation_id or wire_id,
                causation_id=causation_id,
                key=key,
                priority=priority,
                created_at=datetime.now(UTC),
            )
        )
        # A sender's own, non-UUID id travels as it is; a message without a source has no
        # app_id, as from a plain AMQP client.
        wire = replace(wire, message_id=wire_id, app_id=source or None)
        with contextlib.closing(self.broker.publisher()) as publisher:
            [outcome] = publisher.publish_batch([wire], window=1, timeout=5.0)
        if outcome is not PublishOutcome.CONFIRMED:
            raise NotDelivered(f"the broker did not take {kind} {type!r}: {outcome.value}")
        deadline = time.monotonic() + (DELIVERY_WAIT if self.real else 0)
        while self.receive() == 0 and time.monotonic() < deadline:
            pass  # on a real broker the message is on its way to the inbox queue
        if self._find_inbox(stored_id) is None:
            raise NotDelivered(
                f"{kind} {type!r} ({wire_id}) was not stored: the receiver dead-lettered or "
                "delayed it (see the log)"
            )
        return stored_id

    def handle(self, type: str, payload: Any, **options: Any) -> InboxRow:
        """`deliver` one message, `run_until_idle`, and return its inbox row. Takes the keyword
        arguments of `deliver` and, as ``timeout``, of `run_until_idle`."""
        timeout = float(options.pop("timeout", DEFAULT_TIMEOUT))
        message_id = self.deliver(type, payload, **options)
        self.run_until_idle(timeout=timeout)
        return self.inbox_row(message_id)

    def relay(self) -> int:
        """Publish every due outbox row (`Relay.relay_once` until none is left); return the rows
        claimed. As on RabbitMQ, a command no queue takes goes to ``unroutable``, an event nobody
        subscribes to is dropped."""
        return sum(iter(self._relay.relay_once, 0))

    def receive(self) -> int:
        """Store what waits in ``<service>.inbox`` (the receiver's store path); return how many
        deliveries were taken, duplicates included."""
        if self._consumer is None:
            self._consumer = self.broker.consumer(
                inbox_queue(self.service.name), prefetch=self.service.settings.prefetch
            )
        total = 0
        wait = RECEIVE_WAIT if self.real else 0
        while batch := self._consumer.fetch(self.service.settings.receive_batch_size, wait):
            self._receiver.store(self._consumer, batch)
            total += len(batch)
        return total

    def in_flight(self) -> int:
        """Messages ready in the inbox queue, not received yet (0 in memory: none is in flight)."""
        return (self.broker.queue_depth(inbox_queue(self.service.name)) or 0) if self.real else 0

    def work(self) -> int:
        """Run the handlers of every due inbox row (`Worker.work_once` until none is due); return
        the rows claimed, each one handling attempt. A service with ``async def`` handlers is worked
        as docs/testing.md ("The harness") says: on SQLite this raises ConfigurationError."""
        if self.service.handlers.any_async:
            return self._work_async()
        with self._worker.connect() as conn:
            return sum(iter(lambda: self._worker.work_once(conn), 0))

    def _work_async(self) -> int:
        if self.service.sqlite:
            raise ConfigurationError(
                f"service {self.service.name} has async handlers, which run on PostgreSQL only"
                " (psycopg's async driver): give the harness a PostgreSQL database"
                " (OUTBOX_INBOX_HARNESS_DB_URL, or override outbox_inbox_db_url_factory)"
            )
        aio_worker = self.service.async_worker(name=self._worker.name)

        async def drain() -> int:
            total = 0
            try:
                conn = await aio_worker.connect()
                try:
                    while count := await aio_worker.work_once(conn):
                        total += count
                finally:
                    await conn.close()
                    aio_worker.worker.close_liveness()
            finally:
                await aio_worker.close()
            return total

        with ThreadPoolExecutor(1, thread_name_prefix="outbox-inbox-harness") as pool:
            return pool.submit(asyncio.run, drain()).result()

    def skip_delays(self) -> int:
        """Make waiting work due now, as if the time had passed; return the rows changed: inbox
        rows waiting for a retry, and outbox rows written with ``delay=`` that the relay has not
        tried yet (rows the broker refused keep their backoff: `run_until_idle` cannot spin)."""
        o = self.service.tables.outbox
        delayed = (
            update(o)
            .where(outbox_unsent(o), o.c.attempts == 0, o.c.available_at > o.c.created_at)
            .values(available_at=o.c.created_at)
        )
        with self.service.engine.begin() as conn:
            moved = make_retries_due(conn, self.service.tables)
            return moved + int(conn.execute(delayed).rowcount or 0)

    def waiting_in_broker(self) -> int:
        """Messages in this service's delay tier queues: the receiver's own retries, which
        return to the inbox queue when their tier's time is up."""
        tiers = self.service.settings.delay_tiers
        return sum(self.broker.queue_depth(delay_queue(self.service.name, t)) or 0 for t in tiers)

    def run_until_idle(self, *, timeout: float = DEFAULT_TIMEOUT, skip_delays: bool = True) -> int:
        """Run relay, receiver and worker until nothing is due (no outbox row to relay, nothing
        in the inbox queue or its delay tiers, no inbox row due); return the handling attempts
        made. `skip_delays`: fast-forward retry backoff (`skip_delays`). Raises HarnessTimeout
        after `timeout` seconds of continuous work."""
        return run_all_until_idle(self, timeout=timeout, skip_delays=skip_delays)

    def published(
        self, type: str | None = None, *, kind: str | None = None
    ) -> list[PublishedMessage]:
        """Messages the service wrote to its outbox, in the order written, sent or not; `type`
        filters by routing key or topic pattern (``orders.#``), `kind` by command or event."""
        o = self.service.tables.outbox
        with self.service.engine.connect() as conn:
            rows = conn.execute(select(o).order_by(o.c.id)).mappings().all()
        found = [from_row(PublishedMessage, r, sent=r["published_at"] is not None) for r in rows]
        of_type = [m for m in found if type is None or topic_matches(type, m.type)]
        return [m for m in of_type if kind is None or m.kind == kind]

    def inbox_rows(self, status: str | None = None) -> list[InboxRow]:
        """Messages in the service's inbox in the order received, optionally of one `status`."""
        i = self.service.tables.inbox
        stmt = select(i).order_by(i.c.id)
        if status is not None:
            stmt = stmt.where(i.c.status == status)
        with self.service.engine.connect() as conn:
            rows = conn.execute(stmt).mappings().all()
        return [from_row(InboxRow, r) for r in rows]

    def processed(self) -> list[InboxRow]:
        """Inbox messages whose handlers succeeded."""
        return self.inbox_rows(PROCESSED)

    def dead(self) -> list[InboxRow]:
        """Inbox messages that will not be handled again (rejected, out of retries, ...)."""
        return self.inbox_rows(DEAD)

    def inbox_row(self, message_id: uuid.UUID | str) -> InboxRow:
        """The inbox row of one message; raises KeyError if it was never stored."""
        row = self._find_inbox(inbox_id(str(message_id)))
        if row is None:
            raise KeyError(f"no message {message_id} in the inbox of {self.service.name}")
        return row

    def _find_inbox(self, message_id: uuid.UUID) -> InboxRow | None:
        i = self.service.tables.inbox
        with self.service.engine.connect() as conn:
            found = conn.execute(select(i).where(i.c.message_id == message_id)).mappings().first()
        return from_row(InboxRow, found) if found is not None else None

    def describe(self) -> str:
        """A one-line summary of the service's inbox and outbox, for failure messages."""
        counts = dict(Counter(row.status for row in self.inbox_rows()))
        unsent = sum(1 for m in self.published() if not m.sent)
        return f"{self.service.name}: inbox {counts or '{}'}, unsent outbox rows {unsent}"


def run_all_until_idle(
    *harnesses: ServiceHarness, timeout: float = DEFAULT_TIMEOUT, skip_delays: bool = True
) -> int:
    """`ServiceHarness.run_until_idle` of every harness, in turn, until none has anything due:
    a conversation between services on one broker, run to its end."""
    if not harnesses:
        raise ConfigurationError("run_all_until_idle needs at least one harness")
    for harness in harnesses:  # bind the events of handlers registered since (idempotent)
        harness.service.declare_topology()
    deadline = time.monotonic() + timeout
    attempts = 0
    while True:
        busy = False
        for harness in harnesses:
            sent = harness.relay()
            received = harness.receive()
            worked = harness.work()
            attempts += worked
            busy = busy or bool(sent or received or worked)
        if not busy:
            if any(h.in_flight() for h in harnesses):
                continue  # published to a real broker and not yet pushed to the receiver
            if any(h.waiting_in_broker() for h in harnesses):
                time.sleep(0.05)  # the receiver's own retries come back on the broker's timer
            elif not skip_delays or not any([h.skip_delays() for h in harnesses]):
                return attempts
        if time.monotonic() >= deadline:
            state = "; ".join(h.describe() for h in harnesses)
            raise HarnessTimeout(f"not idle after {timeout:g} s: {state}")


def make_retries_due(conn: Connection, tables: Tables) -> int:
    """Make pending inbox rows that wait for a retry due now; return how many changed. The new
    time is the row's own receipt time: in the past by the database's clock on every dialect,
    and the call is idempotent (its condition is false afterwards)."""
    i = tables.inbox
    stmt = (
        update(i)
        .where(i.c.status == PENDING, i.c.next_attempt_at > i.c.received_at)
        .values(next_attempt_at=i.c.received_at)
    )
    return int(conn.execute(stmt).rowcount or 0)


# --- pytest fixtures (registered by the ``pytest11`` entry point ``outbox_inbox``) --------------

#: The fault kit's fixtures, registered with these (a plugin module, not imported here: the
#: kit's role processes run it as ``python -m``, which must find it not imported yet).
pytest_plugins = ["outbox_inbox.testing.faultkit"]

#: The switch to real servers: the fixtures use these when they are set (docs/testing.md).
HARNESS_DB_URL_ENV = "OUTBOX_INBOX_HARNESS_DB_URL"
HARNESS_MQ_URL_ENV = "OUTBOX_INBOX_HARNESS_MQ_URL"


#: What ``outbox_inbox_harness`` accepts: a service, or a function building one from
#: ``db_url=`` and ``broker=`` keyword arguments.
ServiceOrBuilder = Service | Callable[..., Service]

if TYPE_CHECKING or importlib.util.find_spec("pytest") is not None:
    import pytest

    @pytest.fixture
    def outbox_inbox_broker() -> Iterator[Broker]:
        """The broker of this test: a `MemoryBroker` of its own, closed after it; with
        ``OUTBOX_INBOX_HARNESS_MQ_URL`` set, RabbitMQ on a virtual host of the test's own, or
        on the URL's own when none can be made (docs/testing.md, "The switch to real servers")."""
        url = os.environ.get(HARNESS_MQ_URL_ENV)
        if url:
            from urllib.parse import quote, unquote, urlsplit

            from ..brokers.rabbitmq import RabbitMQBroker
            from ..management import ManagementAPI, ManagementUnavailable, default_management_url

            vhost = f"oi_test_{uuid.uuid4().hex[:12]}"
            api_url = os.environ.get("OUTBOX_INBOX_MANAGEMENT_URL") or default_management_url(url)
            api = ManagementAPI(api_url, vhost)
            try:
                api.add_vhost(unquote(urlsplit(url).username or "guest"))
            except ManagementUnavailable:
                yield RabbitMQBroker(url)
                return
            try:
                yield RabbitMQBroker(urlsplit(url)._replace(path="/" + quote(vhost)).geturl())
            finally:
                api.delete_vhost()
            return
        with MemoryBroker(name="test") as broker:
            yield broker

    @pytest.fixture
    def outbox_inbox_db_url_factory(tmp_path: Path) -> Iterator[Callable[[], str]]:
        """A function returning the URL of a new, empty database at each call: a SQLite file in
        the test's ``tmp_path``, or with ``OUTBOX_INBOX_HARNESS_DB_URL`` set a database on that
        server, dropped after the test. Override it in your conftest.py for anything else."""
        url = os.environ.get(HARNESS_DB_URL_ENV)
        if not url:
            numbers = itertools.count(1)
            yield lambda: f"sqlite:///{tmp_path / f'outbox-inbox-{next(numbers)}.db'}"
            return
        from .servers import ExternalPostgres

        server, made = ExternalPostgres(url), list[str]()

        def create() -> str:
            name = f"oi_test_{uuid.uuid4().hex[:12]}"
            server.create_database(name)
            made.append(name)
            return server.url(name)

        try:
            yield create
        finally:
            for name in reversed(made):
                server.drop_database(name)

    @pytest.fixture
    def outbox_inbox_harness(
        outbox_inbox_db_url_factory: Callable[[], str], outbox_inbox_broker: Broker
    ) -> Iterator[Callable[..., ServiceHarness]]:
        """A factory of migrated `ServiceHarness` objects on this test's broker, closed after
        the test (docs/testing.md, "The pytest fixtures"): ``(build)`` calls ``build(db_url=,
        broker=)`` and closes the service it returns; ``(service)`` leaves closing it to you.
        Keyword arguments go to `ServiceHarness`."""
        with contextlib.ExitStack() as closed_after:

            def make(service: ServiceOrBuilder, **options: Any) -> ServiceHarness:
                if not isinstance(service, Service):
                    db_url = outbox_inbox_db_url_factory()
                    built = service(db_url=db_url, broker=outbox_inbox_broker)
                    service = closed_after.enter_context(contextlib.closing(built))
                return closed_after.enter_context(ServiceHarness(service, **options))

            yield make
