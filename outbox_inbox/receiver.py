"""The receiver: stores each message from the service's queue in the inbox table once."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, SQLAlchemyError

from . import tenants as fleet
from .broker import Broker, Consumer, Delivery
from .config import Settings
from .errors import InvalidMessage, TopologyMissing, first_line, missing_partition
from .fingerprint import fingerprint
from .listener import Listener, call
from .messages import (
    H_DEAD_FINGERPRINT,
    H_DEAD_QUEUE,
    H_DEAD_REASON,
    H_LAST_ERROR,
    H_RECEIVE_ATTEMPT,
    H_RETRY_DELAY,
    H_TENANT,
    Message,
    WireMessage,
    _int,
    _property,
    from_row,
    from_wire,
    inbox_id,
)
from .queries import roles
from .role_loop import RoleLoop
from .tables import Tables
from .topology import DEAD_LETTER_EXCHANGE, delay_queue, inbox_queue
from .tracing import Tracing, record_receives

log = logging.getLogger(__name__)

#: Longest wait for a first delivery before the loop looks at its stop event again. Not a batch
#: window: once one delivery is in, the receiver stores what has arrived and does not wait.
FETCH_WAIT = 0.25

#: Dead-letter reasons the receiver writes in ``x-dead-reason``.
INVALID, STORE_FAILED, REDELIVERED = "invalid", "store_failed", "redelivered"
UNKNOWN_TENANT = "unknown_tenant"

#: Seconds a receiver keeps the tenants it read, and delays an unreachable one untried.
TENANTS_REFRESH = 5.0


class Receiver:
    """Consumes ``<service>.inbox`` and inserts batches into the inbox table, each in one
    transaction (``ON CONFLICT (message_id) DO NOTHING``) acknowledged only after its commit:
    a crash before the ack brings the batch back, its stored copies skipped as duplicates. No
    delivery can stop the others: the "Receiver" table of docs/failures.md."""

    def __init__(
        self,
        *,
        service: str,
        engine: Engine,
        tables: Tables,
        broker: Broker,
        settings: Settings,
        listener: Listener | None = None,
        tracing: Tracing | None = None,
        declare: Callable[[], None] | None = None,
        tenants: Any = None,
    ) -> None:
        self._service, self._declare, self._engine, self._tables = service, declare, engine, tables
        self._broker, self._settings, self._listener = broker, settings, listener
        self._tracing = tracing or Tracing(service)
        # A service with tenants (its `tenant_ids` and `tenant`), those read (`_tenant`), until
        # when each unreachable one is not tried, what was acked or forwarded alone in `store`.
        self._tenants, self._own = tenants, (engine, tables)
        self._known: tuple[float, set[str], dict[str, tuple[Engine, Tables]]] = (-1e9, set(), {})
        self._down: dict[str, float] = {}
        self._done: set[int] = set()
        self.stored = 0  # new inbox rows written by this receiver
        self.duplicates = 0  # deliveries dropped as already stored
        self.delayed = 0  # deliveries sent to a delay tier
        self.dead = 0  # deliveries sent to the dead letters

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Receive until `stop` is set; the batch in hand is stored and acked first. `on_started` is
        called once the first consumer is open. Any error is retried (`RoleLoop`), the consumer
        closed first; after TopologyMissing the topology is declared again first (`declare`)."""
        s = self._settings
        consumer: Consumer | None = None
        announce = on_started
        declare: Callable[[], None] | None = None

        def step() -> int:
            nonlocal consumer, announce, declare
            if consumer is None:
                # Only once the database answers (a checkout pings a pooled connection or
                # opens one, both bounded: database.CLIENT_BOUNDS): while it cannot be reached,
                # nothing is taken from the queue, and every message keeps its delivery count.
                with self._engine.connect():
                    pass
                if declare is not None:
                    declare()
                    declare = None
                consumer = self._broker.consumer(inbox_queue(self._service), prefetch=s.prefetch)
            if announce is not None:
                announce()
                announce = None
            batch = consumer.fetch(s.receive_batch_size, FETCH_WAIT)
            if batch:
                self.store(consumer, batch)
            return len(batch)

        def recover(exc: Exception) -> None:
            nonlocal consumer, declare
            if isinstance(exc, TopologyMissing):
                declare = self._declare
            if consumer is not None:
                consumer.close()  # unacked deliveries go back to the queue
                consumer = None

        loop = RoleLoop(f"receiver of {self._service}", s, log, retried=(Exception,))
        try:
            loop.run(stop, step, recover=recover)  # the fetch waits for deliveries itself
        finally:
            if consumer is not None:
                consumer.close()

    def store(
        self, consumer: Consumer, batch: list[Delivery], ack: Callable[..., None] | None = None
    ) -> None:
        """Store one batch; acknowledge, delay or dead-letter every delivery in it: runs of
        first deliveries together with one multiple-ack, each redelivered one alone
        (docs/failures.md). Raises the SQLAlchemyError of a database that cannot be reached,
        the deliveries not stored yet left unacknowledged (the caller closes the consumer).
        With tenants, each tenant's deliveries go to its inbox (`_store_tenant`), and the batch
        is acknowledged once every tenant's are stored (docs/tenants.md); `ack` is internal."""
        self._done.clear()
        if self._tenants is not None and ack is None:
            groups: dict[str, list[Delivery]] = {}
            for delivery in batch:  # a tenant that is not text: unknown, by its repr
                tenant = delivery.message.headers.get(H_TENANT) or ""
                key = tenant if isinstance(tenant, str) else repr(tenant)
                groups.setdefault(key, []).append(delivery)
            stored: list[Delivery] = []
            woken = set()
            for tenant, group in groups.items():
                before = len(stored)
                self._store_tenant(tenant, consumer, group, stored)  # its rows committed here
                if tenant and len(stored) > before:
                    woken.add(tenant)
            if woken and (schema := self._own[1].inbox.schema):  # the fleet's workers
                fleet.wake(self._own[0], schema, fleet.WORKER, woken)
            return self._ack(consumer, stored)
        run: list[Delivery] = []
        for delivery in batch:
            if delivery.redelivered:
                (ack or self._ack)(consumer, self._store_together(consumer, run))
                run = []
                (ack or self._ack)(consumer, self._store_suspect(consumer, delivery))
            else:
                run.append(delivery)
        (ack or self._ack)(consumer, self._store_together(consumer, run))

    def _store_tenant(
        self, tenant: str, consumer: Consumer, group: list[Delivery], stored: list[Delivery]
    ) -> None:
        """Store `group` in `tenant`'s inbox ("": the service's own), what to ack added to
        `stored`; delay it for an unknown tenant (dead in the end: ``unknown_tenant``) or an
        unreachable one (one warning; untried for TENANTS_REFRESH s), the others' stored."""
        first, self._done, reason = len(stored), set(), UNKNOWN_TENANT
        try:  # ValueError, and ConfigurationError: not registered, its entry or registry refused
            inbox = self._tenant(tenant) if tenant else self._own
            reason = STORE_FAILED
            if self._down.get(tenant, 0.0) > time.monotonic():
                raise ValueError(f"tenant {tenant}: unreachable just now")
        except ValueError as exc:
            for delivery in group:
                self._delay(consumer, delivery, str(exc), reason)
            return
        try:
            self._engine, self._tables = inbox
            self.store(consumer, group, lambda _c, done: stored.extend(done))
            self._down.pop(tenant, None)
        except SQLAlchemyError as exc:
            if not tenant or not _database_unavailable(exc):
                raise
            if tenant not in self._down:
                log.warning("receiver: tenant %s is unreachable: %s", tenant, first_line(exc))
            self._down[tenant] = time.monotonic() + TENANTS_REFRESH
            done = self._done | {d.tag for d in stored[first:]}
            for delivery in (d for d in group if d.tag not in done):
                self._delay(consumer, delivery, f"tenant {tenant}: {first_line(exc)}")
        finally:
            self._engine, self._tables = self._own

    def _tenant(self, tenant: str) -> tuple[Engine, Tables]:
        """`tenant`'s inbox, the registry read at most every TENANTS_REFRESH s (kept while it
        raises ConfigurationError). Raises ValueError for a tenant it does not name."""
        if time.monotonic() - self._known[0] >= TENANTS_REFRESH:
            self._known = (time.monotonic(), *self._known[1:])
            self._known = (time.monotonic(), set(self._tenants.tenant_ids()), {})
        _, known, inboxes = self._known
        if tenant not in known:
            raise ValueError(f"no tenant {tenant!r} is registered")
        if tenant not in inboxes:
            inboxes[tenant] = (found := self._tenants.tenant(tenant)).engine, found.tables
        return inboxes[tenant]

    @staticmethod
    def _ack(consumer: Consumer, stored: list[Delivery]) -> None:
        # Every delivery before the last stored one is stored, forwarded or acked by now.
        if stored:
            consumer.ack_through(max(d.tag for d in stored))

    def _store_suspect(self, consumer: Consumer, delivery: Delivery) -> list[Delivery]:
        """Count a redelivered message, committed, then dead-letter or store it alone."""
        counted = _counted_id(delivery.message)
        if counted is not None:
            try:
                with self._engine.begin() as conn:
                    roles.bound_on_server(conn)  # the count's row lock, should we be cut off
                    counts = roles.count_deliveries(conn, self._tables, [counted])
                count, limit = counts.get(counted, 0), self._settings.max_redeliveries
                if stored := count > limit:
                    with self._engine.connect() as conn:
                        stored = roles.is_stored(conn, self._tables, counted)
            except SQLAlchemyError as exc:
                if _database_unavailable(exc):
                    raise  # not counted: it goes back to the queue as it came
                # Not counted, not stored: the database refuses to count it now.
                if self._decode(consumer, delivery) is not None:
                    self._delay(consumer, delivery, first_line(exc))
                return []
            if stored:  # its earlier copy was stored and its ack lost: a duplicate
                self._ack_duplicate(consumer, delivery)
                return []
            if count > limit:
                why = f"redelivered {count} times without being stored (limit {limit})"
                self._dead(consumer, delivery, REDELIVERED, why)
                return []
        return self._store_together(consumer, [delivery])

    def _store_together(self, consumer: Consumer, batch: list[Delivery]) -> list[Delivery]:
        """Decode and insert `batch` in one transaction; return the deliveries to ack. What
        cannot be decoded is dead-lettered; when the insert fails (but for an unreachable
        database: raised), the rows are inserted one by one, only the failing ones
        dead-lettered or delayed."""
        pending: dict[uuid.UUID, tuple[Delivery, dict[str, Any]]] = {}
        repeats: Counter[uuid.UUID] = Counter()  # copies of a message within this batch
        for delivery in batch:
            row = self._decode(consumer, delivery)
            if row is None:
                continue
            if row["message_id"] in pending:  # the same message twice in one batch
                repeats[row["message_id"]] += 1
                self._ack_duplicate(consumer, delivery)
                continue
            pending[row["message_id"]] = (delivery, row)
        items = list(pending.values())
        if not items:
            return []
        try:
            return self._insert(items, repeats)
        except Exception as exc:
            if isinstance(exc, SQLAlchemyError) and _database_unavailable(exc):
                raise
            if len(items) == 1:
                self._set_aside(consumer, items[0][0], exc)
                return []
        stored: list[Delivery] = []
        for item in items:  # some row was refused: find it, store the others
            try:
                stored += self._insert([item], repeats)
            except Exception as exc:
                self._set_aside(consumer, item[0], exc)
        return stored

    def _decode(self, consumer: Consumer, delivery: Delivery) -> dict[str, Any] | None:
        """The inbox row of `delivery`; None when it breaks a rule (then it is dead-lettered)."""
        try:
            return from_wire(delivery.message, max_bytes=self._settings.max_message_bytes)
        except InvalidMessage as exc:
            self._dead(consumer, delivery, INVALID, str(exc))
        except Exception as exc:  # decoding is a function of the delivery: it would fail again
            self._dead(consumer, delivery, INVALID, f"cannot be decoded: {exc!r}")
        return None

    def _set_aside(self, consumer: Consumer, delivery: Delivery, error: Exception) -> None:
        """A row could not be inserted: dead-letter it if the database refused its values,
        else delay it (a missing partition is the database's state, not the row's fault).
        Raises `error` when the database cannot be reached (see `store`)."""
        if isinstance(error, SQLAlchemyError) and _database_unavailable(error):
            raise error
        if isinstance(error, DataError | IntegrityError) and not missing_partition(error):
            self._dead(consumer, delivery, INVALID, f"the database refused it: {first_line(error)}")
        else:
            self._delay(consumer, delivery, first_line(error))

    def _insert(
        self, items: list[tuple[Delivery, dict[str, Any]]], repeats: Mapping[uuid.UUID, int]
    ) -> list[Delivery]:
        """Insert rows in one transaction; return their deliveries, ready to be acked. Every
        delivery dropped as a duplicate is counted in ``inbox_deliveries.duplicates`` there."""
        tracer = self._tracing.tracer()
        started = time.time_ns() if tracer is not None else 0
        with self._engine.begin() as conn:
            # Bound: cut off, the session would keep its message ids locked (`bound_on_server`).
            new = roles.insert_inbox(conn, self._tables, [row for _, row in items], bound=True)
            if repeats or len(new) < len(items):  # the common batch has no duplicate
                ids = (row["message_id"] for _, row in items)
                dropped = {mid: repeats.get(mid, 0) + (0 if mid in new else 1) for mid in ids}
                roles.count_duplicates(conn, self._tables, {m: n for m, n in dropped.items() if n})
        duplicates = len(items) - len(new)
        self.stored += len(new)
        self.duplicates += duplicates
        call(self._listener, "received", len(new), duplicates)
        if self._listener is not None and new:
            # Not handled yet: attempt 0.
            stored = [from_row(Message, r, attempt=0) for _, r in items if r["message_id"] in new]
            call(self._listener, "stored", stored)
        if tracer is not None:
            rows = [(row, row["message_id"] not in new) for _, row in items]
            record_receives(tracer, self._service, rows, started)
        return [delivery for delivery, _ in items]

    def _ack_duplicate(self, consumer: Consumer, delivery: Delivery) -> None:
        consumer.ack(delivery.tag)
        self._done.add(delivery.tag)
        self.duplicates += 1
        call(self._listener, "received", 0, 1)

    def _delay(
        self, consumer: Consumer, delivery: Delivery, error: str, reason: str = STORE_FAILED
    ) -> None:
        """Send a message that could not be stored to its delay tier, or dead past the limit."""
        policy = self._settings.receive_retry
        attempt = (_int(delivery.message.headers.get(H_RECEIVE_ATTEMPT)) or 0) + 1
        if policy.gives_up_after(attempt):
            self._dead(consumer, delivery, reason, f"not stored after {attempt} attempts: {error}")
            return
        wanted = policy.delay(attempt)
        tiers = self._settings.delay_tiers
        tier = next((t for t in tiers if t >= wanted), tiers[-1])
        tier_ms = int(tier * 1000)
        headers = {H_RECEIVE_ATTEMPT: attempt, H_RETRY_DELAY: tier_ms, H_LAST_ERROR: error[:500]}
        # The default exchange ("") routes by queue name.
        consumer.forward(delivery, "", delay_queue(self._service, tier), headers)
        self.delayed += 1
        self._done.add(delivery.tag)

    def _dead(self, consumer: Consumer, delivery: Delivery, reason: str, detail: str) -> None:
        shown = delivery.message.message_id or "(no id)"
        log.error(
            "receiver: dead-lettering message %s: %s", shown, detail, extra={"reason": reason}
        )
        why, queue = f"{reason}: {detail}"[:1000], inbox_queue(self._service)
        headers = {H_DEAD_REASON: why, H_DEAD_QUEUE: queue, H_DEAD_FINGERPRINT: fingerprint(reason)}
        consumer.forward(delivery, DEAD_LETTER_EXCHANGE, self._service, headers)
        self.dead += 1
        self._done.add(delivery.tag)
        call(self._listener, "dead", reason, 1)


def _counted_id(message: WireMessage) -> uuid.UUID | None:
    """The inbox id a delivery is counted under; None without a usable message_id (such a
    message is dead-lettered when decoded, which cannot hang or kill the process)."""
    try:
        message_id = _property(message.message_id, "message_id")  # text, or bytes of UTF-8
        return inbox_id(message_id) if message_id else None
    except Exception:  # not text; or a lone surrogate from an in-process broker
        return None


def _database_unavailable(exc: SQLAlchemyError) -> bool:
    return isinstance(exc, OperationalError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )
