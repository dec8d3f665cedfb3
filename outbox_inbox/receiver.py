"""The receiver: stores each message from the service's queue in the inbox table once."""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from . import queries
from .backoff import Backoff
from .broker import Broker, Consumer, Delivery
from .config import Settings
from .errors import BrokerError, InvalidMessage
from .listener import Listener, call
from .messages import (
    H_DEAD_QUEUE,
    H_DEAD_REASON,
    H_LAST_ERROR,
    H_RECEIVE_ATTEMPT,
    H_RETRY_DELAY,
    from_wire,
)
from .tables import Tables
from .topology import DEAD_LETTER_EXCHANGE, delay_queue, inbox_queue

log = logging.getLogger(__name__)

#: Dead-letter reasons the receiver writes in ``x-dead-reason``.
INVALID, STORE_FAILED, REDELIVERED = "invalid", "store_failed", "redelivered"


class Receiver:
    """Consumes ``<service>.inbox`` and inserts batches into the inbox table.

    A batch is inserted in one transaction (``ON CONFLICT (message_id) DO NOTHING``) and
    acknowledged only after that commit, with one multiple-ack. A crash before the ack brings
    the batch back from the broker; the stored copies are then skipped as duplicates and acked.

    When storing fails (the database is down, or one row is refused) the message goes to the
    delay tier queue the `receive_retry` backoff chooses and comes back through the ``retry``
    exchange; after `receive_retry.max_attempts` it goes to ``<service>.dead_letter``. A
    message without a valid envelope is dead-lettered at once (retrying cannot help). A
    redelivered message is counted in ``inbox_deliveries``; past `max_redeliveries` (it keeps
    crashing receivers) it is dead-lettered. The receiver does no business work.
    """

    def __init__(
        self,
        *,
        service: str,
        engine: Engine,
        tables: Tables,
        broker: Broker,
        settings: Settings,
        listener: Listener | None = None,
    ) -> None:
        self._service = service
        self._engine = engine
        self._tables = tables
        self._broker = broker
        self._settings = settings
        self._listener = listener
        self.stored = 0  # new inbox rows written by this receiver
        self.duplicates = 0  # deliveries dropped as already stored
        self.delayed = 0  # deliveries sent to a delay tier
        self.dead = 0  # deliveries sent to the dead letters

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Receive until `stop` is set; the batch in hand is stored and acked first."""
        s = self._settings
        backoff = Backoff(
            s.reconnect_initial, s.reconnect_max, what=f"receiver of {self._service}", logger=log
        )
        consumer: Consumer | None = None
        started = False
        try:
            while not stop.is_set():
                try:
                    if consumer is None:
                        consumer = self._broker.consumer(
                            inbox_queue(self._service), prefetch=s.prefetch
                        )
                    if not started and on_started:
                        on_started()
                    started = True
                    batch = consumer.fetch(s.receive_batch_size, s.receive_batch_wait)
                    if batch:
                        self.store(consumer, batch)
                    backoff.succeeded()
                except (BrokerError, SQLAlchemyError) as exc:
                    if consumer is not None:
                        consumer.close()  # unacked deliveries go back to the queue
                        consumer = None
                    backoff.failed(exc, stop)
        finally:
            if consumer is not None:
                consumer.close()

    def store(self, consumer: Consumer, batch: list[Delivery]) -> None:
        """Store one batch; acknowledge, delay or dead-letter every delivery in it."""
        pending: dict[uuid.UUID, tuple[Delivery, dict[str, Any]]] = {}
        repeats: Counter[uuid.UUID] = Counter()  # copies of a message within this batch
        for delivery in batch:
            try:
                row = from_wire(delivery.message)
            except InvalidMessage as exc:
                self._dead(consumer, delivery, INVALID, str(exc))
                continue
            if row["message_id"] in pending:  # the same message twice in one batch
                repeats[row["message_id"]] += 1
                self._ack_duplicate(consumer, delivery)
                continue
            pending[row["message_id"]] = (delivery, row)
        if not pending:
            return
        try:
            self._count_redeliveries(consumer, pending)
            stored = self._insert(list(pending.values()), repeats)
        except SQLAlchemyError as exc:
            if _database_unavailable(exc):
                log.warning("receiver: database unavailable, delaying %d messages", len(pending))
                for delivery, _ in pending.values():
                    self._delay(consumer, delivery, _short(exc))
                return
            # One row is refused: store them one by one and delay only the refused ones.
            stored = []
            for delivery, row in pending.values():
                try:
                    stored.extend(self._insert([(delivery, row)], repeats))
                except SQLAlchemyError as one:
                    self._delay(consumer, delivery, _short(one))
        if stored:
            consumer.ack_through(max(d.tag for d in stored))

    def _insert(
        self, items: list[tuple[Delivery, dict[str, Any]]], repeats: Mapping[uuid.UUID, int]
    ) -> list[Delivery]:
        """Insert rows in one transaction; return their deliveries, ready to be acked.

        In the same transaction, every delivery dropped as a duplicate (the message was stored
        before, or came twice in this batch) is counted in ``inbox_deliveries.duplicates``.
        """
        if not items:
            return []
        with self._engine.begin() as conn:
            new = queries.insert_inbox(conn, self._tables, [row for _, row in items])
            if repeats or len(new) < len(items):  # the common batch has no duplicate
                dropped = {
                    mid: repeats.get(mid, 0) + (0 if mid in new else 1)
                    for mid in (row["message_id"] for _, row in items)
                }
                queries.count_duplicates(
                    conn, self._tables, {m: n for m, n in dropped.items() if n}
                )
        duplicates = len(items) - len(new)
        self.stored += len(new)
        self.duplicates += duplicates
        call(self._listener, "received", len(new), duplicates)
        return [delivery for delivery, _ in items]

    def _count_redeliveries(
        self, consumer: Consumer, pending: dict[uuid.UUID, tuple[Delivery, dict[str, Any]]]
    ) -> None:
        """Count redelivered messages; dead-letter those redelivered too often.

        Only deliveries the broker flags as redelivered are counted, so the common path costs
        nothing. The count commits on its own, before the insert: a message that kills the
        receiver is still counted.
        """
        redelivered = [mid for mid, (d, _) in pending.items() if d.redelivered]
        if not redelivered:
            return
        with self._engine.begin() as conn:
            counts = queries.count_deliveries(conn, self._tables, redelivered)
        limit = self._settings.max_redeliveries
        for message_id, count in counts.items():
            if count > limit:
                delivery, _ = pending.pop(message_id)
                self._dead(
                    consumer,
                    delivery,
                    REDELIVERED,
                    f"redelivered {count} times without being stored (limit {limit})",
                )

    def _ack_duplicate(self, consumer: Consumer, delivery: Delivery) -> None:
        consumer.ack(delivery.tag)
        self.duplicates += 1

    def _delay(self, consumer: Consumer, delivery: Delivery, error: str) -> None:
        """Send a message that could not be stored to its delay tier, or dead past the limit."""
        policy = self._settings.receive_retry
        attempt = _int(delivery.message.headers.get(H_RECEIVE_ATTEMPT)) + 1
        if policy.gives_up_after(attempt):
            self._dead(
                consumer, delivery, STORE_FAILED, f"not stored after {attempt} attempts: {error}"
            )
            return
        wanted = policy.delay(attempt)
        tiers = self._settings.delay_tiers
        tier = next((t for t in tiers if t >= wanted), tiers[-1])
        consumer.forward(
            delivery,
            "",  # the default exchange routes by queue name
            delay_queue(self._service, tier),
            {
                H_RECEIVE_ATTEMPT: attempt,
                H_RETRY_DELAY: int(tier * 1000),
                H_LAST_ERROR: error[:500],
            },
        )
        self.delayed += 1

    def _dead(self, consumer: Consumer, delivery: Delivery, reason: str, detail: str) -> None:
        log.error(
            "receiver: dead-lettering message %s: %s",
            delivery.message.message_id or "(no id)",
            detail,
            extra={"reason": reason},
        )
        consumer.forward(
            delivery,
            DEAD_LETTER_EXCHANGE,
            self._service,
            {H_DEAD_REASON: f"{reason}: {detail}"[:1000], H_DEAD_QUEUE: inbox_queue(self._service)},
        )
        self.dead += 1


def _database_unavailable(exc: SQLAlchemyError) -> bool:
    return isinstance(exc, OperationalError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)
