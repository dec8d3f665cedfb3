"""The model drives the code: a Hypothesis state machine over the real library whose rules are
the model's actions and whose invariants are the model's (spec/outbox_inbox.qnt), checked on the
real tables after every step. One machine, two places to run it: SQLite and the in-memory broker
(`InMemory`, the fast loop), and the session's PostgreSQL and RabbitMQ (`OnServers`, marked
``integration``: the full suite).

Rules: a business transaction that writes commands to the service itself and commits or rolls
back; a relay pass and a receiver pass; a lost relay mark (the relay crashed after the broker's
confirm: the row is sent again, a duplicate on the wire); a receiver that stores a batch and
dies before its ack (the broker redelivers the batch when the channel closes: duplicates with
the redelivered flag, which the receiver counts and drops), or dies with the batch before
storing it; a committed message whose decoding kills every receiver that meets it (each dies
there, its deliveries not acked, until the redelivery count, taken before the decode, passes
`max_redeliveries` and the message is dead-lettered: it must then have no effect and count as
finished, after at most `max_redeliveries` deaths at its redeliveries; the first delivery of
each copy the relay published, not a redelivery, may kill one more); a worker pass, whose
handler succeeds, raises Retry, fails, rejects or kills the worker (a BaseException nothing
catches: its transaction rolls back, its claims stay) as each message's drawn plan says; the
leases of those claims running out; the retry delays running out. Every receiver pass takes
each batch as the broker delivers it out of publication order across keys (a drawn
interleaving, each key's own order kept: the model's `consume`).

On PostgreSQL, days pass (the roles catch up first, so no copy of a stored message is left on
its way: the model's `windowPassed`; every time of the tables moves back, the rows into the day
partitions of their new times) and a maintenance pass drops the partitions past the retention
(2 days here, the dead rows' too) while messages flow; a lost relay mark later sends a copy
only of a row younger than the retention (inside the duplicate window: it must be recognized).
A row seen unfinished and then gone fails the run (NothingDroppedInsideDuplicateWindow's
premise: only finished rows go). After the calm, every example lets the retention pass (every
finished row must be gone), then handles a new message, loses its relay mark and lets a day
pass before the copy goes out: it must be recognized, not handled twice.

On a primary and its synchronous standby of the test's own (`FailoverPair`), the database fails
over (once an example): the standby stops receiving while relay, receiver and worker passes run,
the primary is killed and the standby promoted; what it lacked was never committed, every
session ends, and every invariant must hold on the new primary. A process killed outright
between two statements is not driven here (the fault suites kill real processes).

On the servers every example gets a database of its own, copied from a template migrated once
(``CREATE DATABASE … TEMPLATE``: about 85 ms, where a fresh database and the migrations take
about 1.2 s and a fresh schema and the migrations 0.9 s), and a service name of its own, hence
queues of its own in the test's virtual host. An example's teardown drops the one database it
created and the harness deletes the queues it declared (those that did not exist before it);
the test checks that a bystander database and a bystander queue with a message survive.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import pika
import pytest
from e2e.harness import make_synchronous
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql
from sqlalchemy import (
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
    update,
)
from sqlalchemy.exc import SQLAlchemyError

from outbox_inbox import Reject, Retry, RetryPolicy, Service
from outbox_inbox.broker import Broker, Consumer, Delivery
from outbox_inbox.brokers.memory import MemoryBroker
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.messages import H_KEY, from_wire
from outbox_inbox.partitions import INTERVALS, floor_time, partition_name, partitions
from outbox_inbox.partitions import KEYS as PARTITIONED
from outbox_inbox.queries import partitions as ddl
from outbox_inbox.receiver import Receiver
from outbox_inbox.testing import ServiceHarness
from outbox_inbox.testing.injection import StreamingReplica
from outbox_inbox.testing.servers import PostgresHandle, PostgresServer, wait_until
from outbox_inbox.topology import dead_letter_queue, inbox_queue

COMMAND = "thing.do"
KEYS = ("k0", "k1")
DAY = INTERVALS["day"]
#: The retention of the examples on PostgreSQL (above the duplicate horizon, about 1.4 hours
#: with the default settings) and of their dead rows: a few days passing reach both.
RETENTION = DEAD_RETENTION = 2 * DAY
#: The days an example may let pass.
MAX_DAYS = 9
#: How often a premise came up in a test's examples (the test checks its own).
PREMISES: Counter[str] = Counter()
#: Seconds a pass runs while the standby receives nothing before the primary crashes: enough
#: for one that commits asynchronously only, and one that waits for the standby waits this long.
WINDOW = 1.0
OUTCOMES = ("fail", "ok", "retry", "reject", "crash")
#: A choice among what the servers hold at the time (an index, modulo their number). Every draw
#: has a shape fixed by the rule alone: one that depended on what the servers did (a batch's
#: length, the rows published) would make Hypothesis's replay of an example draw differently.
PICK = st.integers(0, 2**16)
#: A transaction's commands: one to three, each of a key and with its handler's outcomes.
PLANS = st.lists(
    st.tuples(st.sampled_from(KEYS), st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=3)),
    min_size=1,
    max_size=3,
)

metadata = MetaData()
business = Table("business", metadata, Column("n", Integer, primary_key=True))
effects = Table(
    "effects",
    metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("n", Integer, nullable=False),
    Column("key", String(8), nullable=False),
)


class WorkerDies(BaseException):
    """Raised by a handler: the worker process dies there (no handler error: nothing in the
    library catches it)."""


class ReceiverDies(BaseException):
    """Raised where the receiver decodes a poisoned message: the receiver process dies there,
    its deliveries not acked (nothing in the library catches it)."""


def _number(delivery: Delivery) -> int | None:
    """The machine's number of the command `delivery` carries (None for another message)."""
    try:
        payload = from_wire(delivery.message)["payload"]
    except Exception:
        return None
    n = payload.get("n") if isinstance(payload, dict) else None
    return n if isinstance(n, int) and delivery.message.routing_key.endswith(COMMAND) else None


class Place:
    """Where one example runs: a database, a broker and a service name of its own.

    `close()` removes what the example created, and nothing else."""

    db_url: str
    broker: Broker
    name: str
    migrated: bool  # the database holds the library's and the business tables already
    partitioned = False  # PostgreSQL: time partitions, dropped by maintenance
    fails_over = False  # a primary and a synchronous standby: `fail_over` promotes it
    failovers: list[tuple[int, int]]  # per failover: relay marks lost, messages unfinished

    def fail_over(self, window: Callable[[], None], last: Callable[[], None]) -> None:
        raise NotImplementedError

    def close(self) -> None: ...


class InMemory(Place):
    """A SQLite file in a temporary directory and a `MemoryBroker`."""

    def __init__(self) -> None:
        self.dir = TemporaryDirectory()
        self.db_url = f"sqlite:///{Path(self.dir.name) / 'billing.db'}"
        self.broker = MemoryBroker()
        self.name = "billing"
        self.migrated = False

    def close(self) -> None:
        self.broker.close()
        self.dir.cleanup()


class OnServers:
    """The session's PostgreSQL and the test's RabbitMQ virtual host. `example()` gives each
    example a database copied from a template migrated once (named ``<prefix>_<n>``) and a
    service of that name; `close()` drops the template."""

    def __init__(self, postgres: PostgresHandle, mq_url: str) -> None:
        self.postgres, self.mq_url = postgres, mq_url
        self.prefix = f"sm_{uuid.uuid4().hex[:8]}"
        self.template = f"{self.prefix}_template"
        self.made: list[str] = []  # every service (and database) name an example took
        #: each failover's relay marks lost, and messages unfinished at it (FailoverPair)
        self.failovers: list[tuple[int, int]] = []
        postgres.create_database(self.template)
        url = postgres.url(self.template)
        service = Service("template", db_url=url, broker=MemoryBroker())
        try:
            service.migrate()
            metadata.create_all(service.engine)
            _days_back(service, legacy=True)
        finally:
            service.close()

    def example(self) -> Place:
        name = f"{self.prefix}_{len(self.made)}"
        with self.postgres.connect() as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(self.template)
                )
            )
        self.made.append(name)
        return _ServersPlace(self, name)

    def url(self, name: str) -> str:
        """The db_url of the example database `name`."""
        return self.postgres.url(name)

    def leftovers(self) -> list[str]:
        """The databases and queues of this run's examples still there (none, after them)."""
        with self.postgres.connect() as conn:
            left = [
                str(row[0])
                for row in conn.execute(
                    "SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                    ([self.template, *self.made],),
                )
            ]
        with contextlib.closing(RabbitMQBroker(self.mq_url)) as broker, broker.operator() as admin:
            for name in self.made:
                for queue in (inbox_queue(name), dead_letter_queue(name)):
                    if admin.queue_info(queue) is not None:
                        left.append(queue)
        return left

    def close(self) -> None:
        self.postgres.drop_database(self.template)


def _days_back(service: Service, days: int = 0, *, legacy: bool = False) -> None:
    """Give each row of both partitioned tables the partition of its time less `days` (made as
    maintenance made it when that day was ahead: retention may have dropped it empty since).
    `legacy`: instead detach and drop the migration's partition, empty (it holds every time
    before the migration's bound: a row made older would stay in it), as retention does once it
    is past, and make the days up to the first one ahead."""
    t, schema = service.tables, service.tables.schema
    with service.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        for parent, key in PARTITIONED.items():
            found = partitions(conn, schema, parent)
            if legacy:
                for p in found:
                    if p.lower is None:
                        ddl.detach(conn, schema, parent, p.name, finalize=False)
                        ddl.drop_table(conn, schema, p.name)
                today = floor_time(datetime.now(UTC), "day")
                ahead = min(p.lower for p in found if p.lower is not None)
                starts = {today + n * DAY for n in range((ahead - today) // DAY)}
            else:
                table = t.outbox if parent == "outbox_messages" else t.inbox
                times = conn.execute(select(table.c[key]).distinct()).scalars()
                starts = {floor_time(at - days * DAY, "day") for at in times}
            names = {p.name for p in found}
            for start in sorted(starts):
                name = partition_name(parent, start, "day")
                if name not in names:
                    ddl.create_partition(conn, schema, parent, name, start, start + DAY)


#: A row while the standby has flushed all the primary has logged (an asynchronous commit's
#: record too, before the primary itself wrote it).
CAUGHT_UP = "SELECT 1 FROM pg_stat_replication WHERE flush_lsn >= pg_current_wal_insert_lsn()"


class FailoverPair(OnServers):
    """A primary of the test's own and its synchronous standby (every commit but those the
    library makes with ``synchronous_commit = off`` waits for the standby's flush); each
    example's db_url names both (``target_session_attrs=read-write``), as an operator writes it.
    `fail_over` crashes the primary and promotes the standby, the primary gone for good; the
    next example first gets a new standby of the new primary."""

    def __init__(self, mq_url: str) -> None:
        self.standby: StreamingReplica | None = None
        primary = PostgresServer(settings={"fsync": "off"})
        try:
            primary.start()
            self.postgres = primary
            self._new_standby()
            super().__init__(primary, mq_url)
        except BaseException:
            self.cleanup()
            raise

    def _new_standby(self) -> None:
        """A standby of the primary, copied from it, synchronous once it streams."""
        primary = self.postgres
        assert isinstance(primary, PostgresServer)
        self.standby = StreamingReplica(primary, name="standby")
        self.standby.start()
        make_synchronous(self.standby)

    def example(self) -> Place:
        if self.standby is None:  # the last example failed over
            self._new_standby()
        return super().example()

    def url(self, name: str) -> str:
        primary, standby = self.postgres, self.standby
        assert isinstance(primary, PostgresServer) and standby is not None
        hosts = f"{primary.host}:{primary.port},{standby.host}:{standby.port}"
        query = f"host={hosts}&target_session_attrs=read-write"
        return f"postgresql+psycopg://{primary.user}@/{name}?{query}"

    def fail_over(self, window: Callable[[], None], last: Callable[[], None]) -> None:
        """The primary crashes and the standby is promoted. The primary's walsender is
        stopped first and `window` runs in a thread meanwhile: what it commits asynchronously
        reaches the primary alone, and a synchronous commit waits for the standby until the
        crash ends its session (a database error of `window`; any other is raised). `last`
        runs on the primary just before the crash."""
        primary, standby = self.postgres, self.standby
        assert isinstance(primary, PostgresServer) and standby is not None
        with primary.connect() as conn:
            wait_until(
                lambda: conn.execute(CAUGHT_UP).fetchone() is not None,
                timeout=10,
                what="the standby to have every commit",
            )
            row = conn.execute("SELECT pid FROM pg_stat_replication").fetchone()
        assert row is not None, "the standby does not stream"
        os.kill(row[0], signal.SIGSTOP)
        failed: list[BaseException] = []

        def run() -> None:
            try:
                window()
            except BaseException as exc:  # looked at once the primary is gone
                failed.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(WINDOW)  # done, or waiting for the standby
        last()
        primary.kill()  # with the stopped walsender: nothing more reaches the standby
        thread.join(30)
        assert not thread.is_alive(), "a session outlived its server"
        if failed and not isinstance(failed[0], SQLAlchemyError | WorkerDies):
            raise failed[0]
        standby.promote()
        with standby.connect() as conn:  # alone until the next example's new standby
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("SELECT pg_reload_conf()")
        primary.cleanup()
        self.postgres, self.standby = standby, None

    def cleanup(self) -> None:
        for server in (self.standby, self.postgres):
            if server is not None:
                server.cleanup()


class _ServersPlace(Place):
    partitioned = True

    def __init__(self, servers: OnServers, name: str) -> None:
        self.servers = servers
        self.db_url = servers.url(name)
        self.broker = RabbitMQBroker(servers.mq_url)
        self.name = name
        self.migrated = True
        self.fails_over = isinstance(servers, FailoverPair)
        self.failovers = servers.failovers

    def fail_over(self, window: Callable[[], None], last: Callable[[], None]) -> None:
        assert isinstance(self.servers, FailoverPair)
        self.servers.fail_over(window, last)

    def close(self) -> None:
        self.broker.close()
        assert self.name in self.servers.made  # the one database this example created
        self.servers.postgres.drop_database(self.name)


class AcksLost:
    """A receiver's consumer whose acknowledgements never reach the broker: the receiver
    stored the batch and died before its ack."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        return self.consumer.fetch(max_count, wait)

    def ack_through(self, tag: int) -> None:
        pass

    def ack(self, tag: int) -> None:
        pass

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        self.consumer.forward(delivery, exchange, routing_key, headers)

    def close(self) -> None:
        self.consumer.close()


def _orders(data: st.DataObject) -> Callable[[list[int]], list[int]]:
    """The broker's order of each batch of a pass: one drawn seed for the pass (`PICK`)."""
    rng = random.Random(data.draw(PICK))
    return lambda order: rng.sample(order, len(order))


class Reordered:
    """A consumer whose broker delivers each batch out of publication order across keys (a
    drawn interleaving; each key's own order kept, and messages without a key anywhere): the
    receiver sees tags rising in the order it is given, as from a broker, and each ack of one
    of them acks the copy it stands for."""

    def __init__(self, consumer: Consumer, draw: Callable[[list[int]], list[int]]) -> None:
        self.consumer, self.draw = consumer, draw
        self.given: dict[int, Delivery] = {}  # the tag the receiver saw -> the broker's delivery
        self.tags = 0

    def fetch(self, max_count: int, wait: float) -> list[Delivery]:
        batch = self.consumer.fetch(max_count, wait)
        keys = [d.message.headers.get(H_KEY) or f"none-{i}" for i, d in enumerate(batch)]
        by_key: defaultdict[str, deque[Delivery]] = defaultdict(deque)
        for key, delivery in zip(keys, batch, strict=True):
            by_key[key].append(delivery)
        out = []
        for i in self.draw(list(range(len(batch)))):
            self.tags += 1
            self.given[self.tags] = by_key[keys[i]].popleft()
            out.append(replace(self.given[self.tags], tag=self.tags))
        return out

    def ack_through(self, tag: int) -> None:
        for seen in sorted(t for t in self.given if t <= tag):
            self.ack(seen)

    def ack(self, tag: int) -> None:
        self.consumer.ack(self.given.pop(tag).tag)

    def forward(
        self, delivery: Delivery, exchange: str, routing_key: str, headers: Mapping[str, Any]
    ) -> None:
        self.consumer.forward(self.given.pop(delivery.tag), exchange, routing_key, headers)

    def close(self) -> None:
        self.consumer.close()


class Protocol(RuleBasedStateMachine):
    def __init__(self, place: Callable[[], Place] = InMemory) -> None:
        super().__init__()
        self.place = place()
        try:
            self._open()
        except BaseException:
            self.place.close()
            raise

    def _open(self) -> None:
        self.name = self.place.name
        self.service = Service(
            self.name,
            db_url=self.place.db_url,
            broker=self.place.broker,
            retry=RetryPolicy(initial=60, max_attempts=3),  # retries wait for `retries_due`
            retention=RETENTION.total_seconds(),
            dead_retention=DEAD_RETENTION.total_seconds(),
        )
        self.plans: dict[int, list[str]] = {}
        self.calls: defaultdict[int, int] = defaultdict(int)
        self.keys: dict[int, str] = {}
        self.committed: set[int] = set()
        self.next_n = 0
        self.batches_lost = 0
        self.days = 0  # the days passed (`days_pass`)
        self.dropped: list[str] = []  # the partitions maintenance dropped
        self.seen: dict[int, str] = {}  # each inbox row's status when last seen
        self.gone: set[int] = set()  # messages whose inbox row retention dropped
        self.faults: set[str] = set()  # the causes of the faults seen in the outbox
        self.failed_over = False
        self.poisoned: set[int] = set()  # messages whose decoding kills the receiver, every time
        self.deaths: Counter[tuple[int, bool]] = Counter()  # (message, redelivered) -> kills
        self.dead_lettered: set[int] = set()  # messages the receiver dead-lettered
        self.service.on_command(COMMAND)(self._handler)
        self.harness = ServiceHarness(self.service, migrate=not self.place.migrated)
        if not self.place.migrated:
            metadata.create_all(self.service.engine)
        self.receiver = self._dying(self.service.receiver())
        self._dying(self.harness._receiver)
        self.wait = 0.0 if isinstance(self.place.broker, MemoryBroker) else 0.05

    def _dying(self, receiver: Receiver) -> Receiver:
        """`receiver`, dying where it decodes a poisoned message (`poison_a_message`), and
        noting the messages it dead-letters."""
        decode, dead = receiver._decode, receiver._dead

        def decoding(consumer: Any, delivery: Delivery) -> dict[str, Any] | None:
            row = decode(consumer, delivery)
            n = _number(delivery)
            if row is not None and n in self.poisoned:
                self.deaths[n, delivery.redelivered] += 1
                raise ReceiverDies(f"the receiver dies decoding message {n}")
            return row

        def dead_lettering(consumer: Any, delivery: Delivery, reason: str, detail: str) -> None:
            dead(consumer, delivery, reason, detail)
            if (n := _number(delivery)) is not None:
                self.dead_lettered.add(n)

        receiver._decode, receiver._dead = decoding, dead_lettering  # type: ignore[method-assign]
        return receiver

    def _handler(self, message: Any, session: Any) -> None:
        n = int(message.payload["n"])
        plan = self.plans[n]
        outcome = plan[min(self.calls[n], len(plan) - 1)]
        self.calls[n] += 1
        session.execute(effects.insert().values(n=n, key=self.keys[n]))
        if outcome == "retry":
            raise Retry()
        if outcome == "fail":
            raise RuntimeError(f"message {n} fails")
        if outcome == "reject":
            raise Reject(f"message {n} is refused")
        if outcome == "crash":
            raise WorkerDies(f"the worker dies in message {n}'s handler")

    def teardown(self) -> None:
        try:
            self.harness.close()
            self.service.close()
        finally:
            self.place.close()

    def _receive(
        self,
        *,
        lose_acks: bool = False,
        store: bool = True,
        reorder: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        """A receiver pass on a consumer of its own, closed at the end: the unacknowledged
        deliveries go back to the queue, flagged redelivered."""
        consumer: Consumer = self.place.broker.consumer(
            inbox_queue(self.name), prefetch=self.service.settings.prefetch
        )
        if reorder is not None:
            consumer = Reordered(consumer, reorder)
        target = AcksLost(consumer) if lose_acks else consumer
        try:
            size = self.service.settings.receive_batch_size
            while (batch := consumer.fetch(size, self.wait)) and store:
                self.receiver.store(target, batch)
        except ReceiverDies:
            pass  # its consumer closes: the deliveries not acked go back, flagged redelivered
        finally:
            consumer.close()

    # ---- the model's actions -----------------------------------------------------------------

    @initialize(plans=PLANS)
    def first_write(self, plans: list[tuple[str, list[str]]]) -> None:
        """Every example starts with a committed transaction (Hypothesis's first examples
        would otherwise draw none, the simplest choice)."""
        self.write(True, plans)

    @rule(commit=st.sampled_from((True, True, False)), plans=PLANS)
    def write(self, commit: bool, plans: list[tuple[str, list[str]]]) -> None:
        """A business transaction writes its rows and a command for each (one to three, each
        of its key), then commits or rolls back."""
        with self.service.session() as session:
            session.begin()
            written = []
            for key, plan in plans:
                n = self.next_n
                self.next_n += 1
                self.plans[n] = plan
                self.keys[n] = key
                written.append(n)
                session.execute(business.insert().values(n=n))
                self.service.outbox.send(session, self.name, COMMAND, {"n": n}, key=key)
            if commit:
                session.commit()
                self.committed.update(written)
            else:
                session.rollback()

    @rule(data=st.data())
    def relay_and_receive(self, data: st.DataObject) -> None:
        """The relay publishes what is due, the receiver stores what the queue holds, each
        batch as the broker delivers it: in a drawn order across keys, each key's own order
        kept (the model's `consume` takes the first message of any key)."""
        self.harness.relay()
        self._receive(reorder=_orders(data))

    @precondition(lambda self: self.place.partitioned and self.days < MAX_DAYS)
    @rule(days=st.integers(1, 3))
    def days_pass(self, days: int) -> None:
        """The relay, the receiver and the worker catch up (no copy of a stored message is left
        on its way; a row waiting for a retry or a lease stays pending), `days` pass (every time
        of the outbox, the inbox and the delivery counters moves back: the rows move to the day
        partition of their new time, and leases and retry delays end), and a maintenance pass
        drops the partitions past the retention. A poisoned message on its way is a copy too:
        the receivers it kills pass after pass until it is dead-lettered are part of the
        catching up (a broker redelivers at once, not days later)."""
        self.harness.relay()
        for _ in range(self.service.settings.max_redeliveries + 2):
            deaths = self.deaths.total()
            self._receive()
            if self.deaths.total() == deaths:
                break
        self.work()
        self.dead_message_has_no_effect_and_its_fault()  # what finished now, before it is dropped
        self._pass(days)

    def _pass(self, days: int) -> None:
        """`days` pass at once, then a maintenance pass (`days_pass` without the catching up)."""
        _days_back(self.service, days)
        t = self.service.tables
        with self.service.engine.begin() as conn:
            for table in (t.outbox, t.inbox, t.deliveries):
                times = {c.name: c - days * DAY for c in table.c if isinstance(c.type, DateTime)}
                conn.execute(update(table).values(times))
        self.days += days
        self.dropped += self.service.maintain().dropped

    @rule(data=st.data())
    def lose_the_receivers_acks(self, data: st.DataObject) -> None:
        """The relay publishes; the receiver stores the batch and dies before its ack: the
        broker delivers it again (a duplicate, flagged redelivered), which the next receiver
        pass counts and drops."""
        self.harness.relay()
        self._receive(lose_acks=True, reorder=_orders(data))

    @precondition(lambda self: self.batches_lost < self.service.settings.max_redeliveries)
    @rule()
    def lose_the_receivers_batch(self) -> None:
        """The relay publishes; the receiver dies with the batch before storing it: the
        broker delivers it again, flagged redelivered, which the next pass counts and stores.
        (Past `max_redeliveries` of these the receiver would dead-letter the message, which
        the model's liveness does not cover: hence the precondition.)"""
        self.batches_lost += 1
        self.harness.relay()
        self._receive(store=False)

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def lose_a_relay_mark(self, data: st.DataObject) -> None:
        """The relay crashed after the confirm, before its mark: the row goes out again. After
        days passed, only a row younger than the retention: the copy arrives inside the
        duplicate window, and the inbox must recognize it."""
        o = self.service.tables.outbox
        sent = select(o.c.id).where(o.c.published_at.is_not(None))
        if self.days:
            sent = sent.where(o.c.created_at > func.now() - RETENTION)
        pick = data.draw(PICK)
        with self.service.engine.begin() as conn:
            if ids := sorted(conn.execute(sent).scalars()):
                chosen = ids[pick % len(ids)]
                conn.execute(update(o).where(o.c.id == chosen).values(published_at=None))

    @precondition(lambda self: self.place.fails_over and not self.failed_over)
    @rule(plans=PLANS)
    def fail_over(self, plans: list[tuple[str, list[str]]]) -> None:
        """The database fails over to its synchronous standby (the model's `failover`): what
        the standby lacks was never committed, and every session ends (the relay forgets its
        batch, the receiver's deliveries go back to the queue, the worker comes back under a
        new name, its liveness lock gone). A transaction commits and the first `cut` (0, 1, 2,
        in turn from one failover to the next) of a relay, a receiver and a worker pass run;
        once the standby has all of it, it receives nothing more while the other passes run in
        turn: their asynchronous commits (the relay's marks, the worker's lone claims) reach
        the primary alone and are lost with it, and the first synchronous one waits until the
        crash ends its session, its outcome unknown to its role. An inbox row the primary
        showed is never lost (the receiver acks what it stored)."""
        o, i = self.service.tables.outbox, self.service.tables.inbox
        published = select(func.count()).where(o.c.published_at.is_not(None))
        stored = select(func.count()).select_from(i)
        before: list[int] = []

        def last() -> None:  # on the primary, just before it crashes
            with self.service.engine.connect() as conn:
                before.extend(conn.execute(q).scalar_one() for q in (published, stored))

        self.write(True, plans)
        cut = len(self.place.failovers) % 3
        passes = [self.harness.relay, self._receive, self.work]
        for step in passes[:cut]:
            step()

        def window() -> None:
            for step in passes[cut:]:
                step()

        self.place.fail_over(window, last)
        self.failed_over = True
        self.service.engine.dispose()
        self.harness._relay = self.service.relay()
        self.harness._receiver = self.receiver = self._dying(self.service.receiver())
        with self.service.engine.connect() as conn:
            after = [conn.execute(q).scalar_one() for q in (published, stored)]
        assert after[1] == before[1], f"{before[1] - after[1]} inbox rows seen, then lost"
        _, _, rows = self._rows()
        unfinished = [n for n in self.committed if not self._finished(rows, n)]
        self.place.failovers.append((before[0] - after[0], len(unfinished)))

    @rule()
    def work(self) -> None:
        """A worker pass; a worker that dies in a handler leaves its transaction rolled back
        and its claims held until their lease ends."""
        with contextlib.suppress(WorkerDies):
            self.harness.work()

    @precondition(lambda self: self.committed - self.poisoned)
    @rule(data=st.data())
    def poison_a_message(self, data: st.DataObject) -> None:
        """A committed message not stored yet kills every receiver that decodes it (a body
        that crashes the decoder): each receiver pass that meets it dies there, its deliveries
        not acked, until the count of its redeliveries, taken before the decode, passes
        `max_redeliveries` and a receiver dead-letters it undecoded (the model's
        `countDelivery`). It never has an effect, and is then finished (the model's `dlq`)."""
        pick = data.draw(PICK)
        _, _, rows = self._rows()
        if fresh := sorted(self.committed - rows.keys() - self.gone - self.poisoned):
            self.poisoned.add(fresh[pick % len(fresh)])

    @rule()
    def leases_end(self) -> None:
        """The leases of the claims a dead worker left run out (by the database's clock)."""
        i = self.service.tables.inbox
        with self.service.engine.begin() as conn:
            conn.execute(
                update(i)
                .where(i.c.status == "pending", i.c.locked_until.is_not(None))
                .values(locked_until=i.c.received_at)
            )

    @rule()
    def retries_due(self) -> None:
        self.harness.skip_delays()

    # ---- the model's invariants, on the real tables ------------------------------------------

    def _rows(self) -> tuple[dict[int, int], list[tuple[int, int, str]], dict[int, Any]]:
        i = self.service.tables.inbox
        with self.service.engine.connect() as conn:
            done = set(conn.execute(select(business.c.n)).scalars())
            ordered = conn.execute(select(effects).order_by(effects.c.seq))
            log = [(r.seq, r.n, r.key) for r in ordered]
            rows = {
                int(r.payload["n"]): r
                for r in conn.execute(
                    select(i.c.message_id, i.c.routing_key, i.c.payload, i.c.status)
                ).all()
                if r.routing_key == f"{self.name}.{COMMAND}"
            }
        counts: dict[int, int] = defaultdict(int)
        for _, n, _ in log:
            counts[n] += 1
        assert done == self.committed, "the business rows are the committed transactions'"
        for n, row in rows.items():
            self.seen[n] = row.status
        for n in self.seen.keys() - rows.keys() - self.gone:
            # NothingDroppedInsideDuplicateWindow's premise: retention drops finished rows only
            assert self.seen[n] in ("processed", "dead"), f"message {n}'s {self.seen[n]} row lost"
            self.gone.add(n)
        return counts, log, rows

    def _finished(self, rows: dict[int, Any], n: int) -> bool:
        """Whether message `n` is processed or dead (its row maybe dropped since), or was
        dead-lettered by the receiver and never stored (the model's `dlq`)."""
        if n in self.dead_lettered and n not in rows and n not in self.gone:
            return True
        return n in self.gone or (n in rows and rows[n].status in ("processed", "dead"))

    @invariant()
    def exactly_once_effect(self) -> None:
        counts, _, rows = self._rows()
        assert all(c <= 1 for c in counts.values()), counts
        for n, row in rows.items():
            if row.status == "processed":
                assert counts[n] == 1, (n, counts)

    @invariant()
    def no_effect_without_commit(self) -> None:
        counts, _, _ = self._rows()
        assert set(counts) <= self.committed

    @invariant()
    def key_order_of_effects(self) -> None:
        _, log, rows = self._rows()
        for _, n, key in log:
            for earlier in self.committed:
                if earlier < n and self.keys[earlier] == key:
                    assert self._finished(rows, earlier), (
                        f"message {n} had its effect before {earlier} of key {key} finished"
                    )

    @invariant()
    def dead_message_has_no_effect_and_its_fault(self) -> None:
        counts, _, rows = self._rows()
        dead = {n: row for n, row in rows.items() if row.status == "dead"}
        if not dead:
            return
        o = self.service.tables.outbox
        with self.service.engine.connect() as conn:
            faults = select(o.c.causation_id).where(o.c.routing_key.like(f"{self.name}.fault.%"))
            # remembered: retention drops a fault's outbox row before its dead inbox row
            self.faults.update(str(c) for c in conn.execute(faults).scalars())
        for n, row in dead.items():
            assert counts[n] == 0, f"dead message {n} has an effect"
            cause = str(uuid.UUID(str(row.message_id)))
            assert cause in self.faults, f"dead message {n} sent no fault"

    def check_liveness(self) -> None:
        """Once nothing more is injected, every committed message finishes: a handler that
        kills its worker each time ends its message dead (abandoned) after a few leases."""
        s = self.service.settings
        rounds = (s.abandon_after + 2) * (len(self.committed) + 1) + s.max_redeliveries + 1
        for _ in range(rounds * (1 + len(self.poisoned))):
            self.leases_end()
            try:
                self.harness.run_until_idle()
                break
            except WorkerDies:
                pass
            except ReceiverDies:  # the harness's consumer dies with it: its deliveries go back
                self.harness._consumer.close()  # type: ignore[union-attr]
                self.harness._consumer = None
        _, _, rows = self._rows()
        for n in self.committed:
            assert self._finished(rows, n), (n, rows.get(n))
        # Counted before its decode, a poisoned message kills at most max_redeliveries
        # receivers at its redeliveries, then it is dead-lettered. (The first delivery of each
        # copy the relay published, after a lost mark, is not a redelivery: not counted.)
        for (n, redelivered), deaths in self.deaths.items():
            if redelivered:
                assert deaths <= s.max_redeliveries, f"message {n} killed {deaths} receivers"
        PREMISES["poison dead-lettered"] += len(self.poisoned & self.dead_lettered - rows.keys())


class ProtocolThenCalm(Protocol):
    def teardown(self) -> None:
        try:
            if self.place.fails_over and not self.failed_over:  # every example fails over
                self.fail_over([(KEYS[0], ["ok"])])
            self.check_liveness()
            self.exactly_once_effect()
            self.key_order_of_effects()
            self.dead_message_has_no_effect_and_its_fault()
            if self.place.partitioned:
                # Past the retention every finished row's partition goes, with no effect, no
                # order and no fault seen before...
                self.days_pass(RETENTION // DAY + 1)
                _, _, rows = self._rows()
                assert not rows, f"finished rows kept past the retention: {sorted(rows)}"
                # ...and inside it a copy is recognized: a new message handled, the relay's
                # mark lost, its copy sent a day later.
                self.write(True, [(KEYS[0], ["ok"])])
                self.harness.run_until_idle()
                o = self.service.tables.outbox
                with self.service.engine.begin() as conn:
                    conn.execute(update(o).values(published_at=None))
                self._pass(1)
                self.harness.run_until_idle()
                self.exactly_once_effect()
                self.check_liveness()
        finally:
            super().teardown()


# Derandomized: the same sequences on every run, so a red run is red again; no shrinking, which
# takes minutes here (the failing sequence is printed as found).
def _settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def test_protocol_driven_by_the_model_in_memory() -> None:
    """The machine on SQLite and the in-memory broker (the fast loop); among its runs, a
    poisoned message dead-lettered by the receiver (the model's `dlq`)."""
    PREMISES.clear()
    run_state_machine_as_test(ProtocolThenCalm, settings=_settings(40, 30))
    assert PREMISES["poison dead-lettered"] >= 1, PREMISES


@pytest.mark.integration
def test_protocol_across_failovers_to_a_synchronous_standby(
    local_postgres_server: PostgresHandle, mq_url: str
) -> None:
    """The machine on a primary and its synchronous standby of this test's own, with the
    failover among its rules (once an example, at its end if no step drew it: the next example
    gets a new standby), the invariants read on whichever server is the primary. Both servers
    are gone after it."""
    pair = FailoverPair(mq_url)

    class ThroughFailovers(ProtocolThenCalm):
        def __init__(self) -> None:
            super().__init__(pair.example)

    try:
        run_state_machine_as_test(ThroughFailovers, settings=_settings(8, 20))
    finally:
        try:
            pair.close()
        finally:
            pair.cleanup()
    assert pair.made and all(s.temp_dir is None for s in (pair.postgres, pair.standby) if s)
    # The premises: failovers that lost relay marks the primary had (the model's
    # W_failoverLost), and failovers with messages unfinished, then finished (W_failoverRecovered).
    print(f"failovers (relay marks lost, messages unfinished): {pair.failovers}")
    assert len(pair.failovers) >= 3  # each `cut`
    assert sum(marks > 0 for marks, _ in pair.failovers) >= 1
    assert sum(unfinished > 0 for _, unfinished in pair.failovers) >= 2


@pytest.mark.integration
def test_protocol_on_postgres_and_rabbitmq(
    postgres_server: PostgresHandle, db_url: str, mq_url: str
) -> None:
    """The same machine on PostgreSQL and RabbitMQ, fewer and shorter examples (each pass on
    RabbitMQ waits for deliveries on their way); every example's database and queues are gone
    after it, and another test's database (`db_url`) and queue are left as they were."""
    bystander_queue = f"bystander-{uuid.uuid4().hex[:8]}.inbox"  # another test's
    with pika.BlockingConnection(pika.URLParameters(mq_url)) as conn:
        channel = conn.channel()
        channel.queue_declare(bystander_queue)
        channel.basic_publish("", bystander_queue, b"not the examples'")
    servers = OnServers(postgres_server, mq_url)

    class OnTheseServers(ProtocolThenCalm):
        def __init__(self) -> None:
            super().__init__(servers.example)

    try:
        PREMISES.clear()
        run_state_machine_as_test(OnTheseServers, settings=_settings(20, 25))
    finally:
        servers.close()
    assert PREMISES["poison dead-lettered"] >= 1, PREMISES
    assert servers.made and servers.leftovers() == []
    engine = create_engine(db_url)
    with engine.connect() as bystander:
        assert bystander.exec_driver_sql("SELECT 1").scalar() == 1
    engine.dispose()
    with pika.BlockingConnection(pika.URLParameters(mq_url)) as conn:
        channel = conn.channel()
        kept = channel.queue_declare(bystander_queue, passive=True)
        assert kept.method.message_count == 1
        channel.queue_delete(bystander_queue)
