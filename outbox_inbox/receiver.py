"""The receiver: stores each message from the service's queue in the inbox table once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from . import queries
from .backoff import Backoff
from .broker import Broker, Consumer, Delivery
from .config import Settings
from .errors import BrokerError, InvalidMessage
from .listener import Listener, call
from .messages import from_wire
from .tables import Tables
from .topology import DEAD_LETTER_EXCHANGE, inbox_queue

log = logging.getLogger(__name__)


class Receiver:
    """Consumes ``<service>.inbox`` and inserts batches into the inbox table.

    A batch is inserted in one transaction (``ON CONFLICT (message_id) DO NOTHING``) and
    acknowledged only after that commit, with one multiple-ack. A crash before the ack brings
    the batch back from the broker; the stored copies are then skipped as duplicates and acked.
    A message without a valid envelope is republished to ``dead_letter`` with the reason.
    The receiver does no business work.
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

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Receive until `stop` is set; the batch in hand is stored and acked first."""
        s = self._settings
        backoff = Backoff(s.reconnect_initial, s.reconnect_max)
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
                    backoff.reset()
                except (BrokerError, SQLAlchemyError) as exc:
                    log.warning("receiver: %s; reconnecting", _short(exc))
                    if consumer is not None:
                        consumer.close()  # unacked deliveries go back to the queue
                        consumer = None
                    backoff.sleep(stop)
        finally:
            if consumer is not None:
                consumer.close()

    def store(self, consumer: Consumer, batch: list[Delivery]) -> None:
        """Insert one batch and acknowledge it after the commit."""
        rows: dict[Any, dict[str, Any]] = {}
        last_tag = 0
        for delivery in batch:
            try:
                row = from_wire(delivery.message)
            except InvalidMessage as exc:
                log.error(
                    "receiver: dead-lettering an invalid message: %s",
                    exc,
                    extra={"message_id": delivery.message.message_id},
                )
                consumer.dead_letter(
                    delivery, DEAD_LETTER_EXCHANGE, self._service, f"invalid: {exc}"
                )
                continue
            rows.setdefault(row["message_id"], row)
            last_tag = max(last_tag, delivery.tag)
        if rows:
            with self._engine.begin() as conn:
                new = queries.insert_inbox(conn, self._tables, list(rows.values()))
            self.stored += new
            self.duplicates += len(batch) - new
            call(self._listener, "received", new, len(batch) - new)
        if last_tag:
            consumer.ack_through(last_tag)


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else repr(exc)
