"""The relay: publishes committed outbox rows to the broker and marks them after the confirm."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import SQLAlchemyError

from . import queries
from .backoff import Backoff
from .broker import Broker, Publisher, PublishOutcome
from .config import Settings
from .errors import BrokerError
from .listener import Listener, call
from .messages import COMMAND, OutgoingMessage, WireMessage, to_wire
from .tables import Tables
from .waker import Waker

log = logging.getLogger(__name__)

_PUBLISHED = (PublishOutcome.CONFIRMED, PublishOutcome.RETURNED)


def outgoing(row: RowMapping, source: str) -> OutgoingMessage:
    """The message an outbox row carries."""
    return OutgoingMessage(
        id=row["id"],
        message_id=row["message_id"],
        kind=row["kind"],
        exchange=row["exchange"],
        routing_key=row["routing_key"],
        payload=row["payload"],
        headers=row["headers"] or {},
        source=source,
        version=row["version"],
        correlation_id=row["correlation_id"],
        causation_id=row["causation_id"],
        key=row["key"],
        priority=row["priority"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        attempt=row["attempts"] + 1,
    )


class Relay:
    """Moves outbox rows to the broker. Run one or several, in threads or processes.

    Each batch is one database transaction: claim rows (``FOR UPDATE SKIP LOCKED``), publish
    them with confirms, mark the confirmed ones published, count a failed attempt on the rest,
    commit. A crash anywhere before the commit leaves the rows unpublished, so they are sent
    again and the receiving inbox drops the copy. A returned event (no queue subscribes to
    it) counts as published; a returned command does not. `run` keeps up to three batches
    open at once, each in its own transaction, so that the broker confirms one while the
    relay claims and encodes the next (see `_relay_stream`).
    """

    def __init__(
        self,
        *,
        service: str,
        engine: Engine,
        tables: Tables,
        broker: Broker,
        settings: Settings,
        waker_factory: Callable[[threading.Event], Waker | None] | None = None,
        listener: Listener | None = None,
    ) -> None:
        self._service = service
        self._listener = listener
        self._engine = engine
        self._tables = tables
        self._broker = broker
        self._settings = settings
        self._waker_factory = waker_factory
        self._publisher: Publisher | None = None
        self.published = 0  # messages marked published by this relay (for tests and status)
        self.expired = 0  # messages marked expired instead

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Relay batches until `stop` is set; the batch in hand is finished first."""
        waker = self._waker_factory(stop) if self._waker_factory else None
        s = self._settings
        backoff = Backoff(
            s.reconnect_initial, s.reconnect_max, what=f"relay of {self._service}", logger=log
        )
        if on_started:
            on_started()
        try:
            while not stop.is_set():
                try:
                    count = self._relay_stream(stop)
                    backoff.succeeded()
                except BrokerError as exc:
                    self._drop_publisher()
                    backoff.failed(f"broker unavailable: {exc}", stop)
                    continue
                except SQLAlchemyError as exc:
                    backoff.failed(f"database unavailable: {_short(exc)}", stop)
                    continue
                if count < self._settings.relay_batch_size:
                    if self._publisher is not None:
                        self._publisher.idle()  # heartbeats: an idle link must stay known alive
                    if waker is not None:
                        waker.wait(self._settings.relay_poll_interval)
                    else:
                        stop.wait(self._settings.relay_poll_interval)
        finally:
            self._drop_publisher()
            if waker is not None:
                waker.close()

    def relay_once(self) -> int:
        """Relay one batch; return how many rows were claimed."""
        s = self._settings
        with self._engine.connect() as conn, conn.begin():
            rows, count = self._claim(conn)
            if not rows:
                return count
            publisher = self._ensure_publisher()
            messages = [outgoing(row, self._service) for row in rows]
            outcomes = publisher.publish_batch(
                [to_wire(m) for m in messages], window=s.publish_window, timeout=s.confirm_timeout
            )
            marking = _Marking.of(rows)
            published = self._mark(conn, marking, outcomes, messages)
        self._committed(published, messages)
        if publisher.broken:
            self._drop_publisher()
            raise BrokerError("publishing connection broke during the batch")
        return count

    def _relay_stream(self, stop: threading.Event) -> int:
        """Relay batches back to back, each in its own transaction, until the backlog is gone.

        While the broker confirms one batch, the next ones are claimed on other connections
        (up to `_PIPELINE_DEPTH` batches open at once) and their messages go out as the
        confirms free room in the window, so the broker is not left idle while the relay
        claims, encodes, marks and commits. A batch is marked and committed once all its
        confirms are in, in claim order. The open transactions hold their rows and keys
        exactly as several relays would, so nothing changes for ordering: a later claim skips
        the rows and keys an earlier one holds. Without a publisher that can keep batches
        going, or on SQLite (one writing transaction at a time), this is `relay_once`.
        Returns the row count of the last claim; stops claiming once `stop` is set, and always
        finishes the batches in hand first.
        """
        s = self._settings
        if self._engine.dialect.name != "postgresql":
            return self.relay_once()
        publisher = self._ensure_publisher()
        if not isinstance(publisher, _Pipelined):
            return self.relay_once()
        in_hand: deque[_Batch] = deque()
        count = 0  # rows of the last claim
        more = True  # a further claim may find rows
        full = True  # the last claim found a whole batch
        error: Exception | None = None
        try:
            while True:
                if (
                    more
                    and error is None
                    and len(in_hand) < _PIPELINE_DEPTH
                    and (full or not in_hand)
                    and not stop.is_set()
                    and not publisher.broken
                ):
                    alone = not in_hand
                    try:
                        batch, count = self._open_batch(publisher)
                    except (BrokerError, SQLAlchemyError) as exc:
                        error = exc  # finish the batches in hand, then report it
                        continue
                    full = count >= s.relay_batch_size
                    # A short claim next to a batch in hand may only have missed what that
                    # batch holds: claim again once it is done. A short claim alone means the
                    # backlog is gone.
                    more = full or not alone
                    if batch is not None:
                        in_hand.append(batch)
                    continue
                if not in_hand:
                    break
                head = in_hand[0]
                if not head.publishing.done:
                    publisher.pump(_PUMP_WAIT)
                    continue
                in_hand.popleft()
                self._finish(head, publisher)
        except BaseException:
            for batch in in_hand:
                batch.abort()
            if in_hand:
                # Their messages may still be unconfirmed: do not leave them on this channel.
                self._drop_publisher()
            raise
        if error is not None:
            raise error
        if publisher.broken:
            self._drop_publisher()
            raise BrokerError("publishing connection broke during the batch")
        return count

    def _open_batch(self, publisher: _Pipelined) -> tuple[_Batch | None, int]:
        """Claim a batch in a new transaction and start publishing it.

        Returns the batch (None when no row is to be published, the transaction then being
        committed) and the claimed row count, as `relay_once` counts it.
        """
        s = self._settings
        conn = self._engine.connect()
        try:
            transaction = conn.begin()
            rows, count = self._claim(conn)
            if not rows:
                transaction.commit()
                conn.close()
                return None, count
            # The broker keeps confirming while this relay works: settle its confirms and
            # refill the window from the batches already started, now and then.
            publisher.pump(0)
            # Only the wire messages and what marking needs stay until the batch is committed
            # (the rows, payloads and messages too if a listener is to see them): objects
            # that outlive a few collections make the garbage collector's full passes
            # frequent and long.
            keep = self._listener is not None
            messages: list[OutgoingMessage] = []
            wires: list[WireMessage] = []
            for n, row in enumerate(rows, 1):
                message = outgoing(row, self._service)
                wires.append(to_wire(message))
                if keep:
                    messages.append(message)
                if not n % _PUMP_EVERY:
                    publisher.pump(0)
            marking = _Marking.of(rows)
            publishing = publisher.start_batch(
                wires, window=s.publish_window, timeout=s.confirm_timeout
            )
        except BaseException:
            conn.close()  # rolls the claim back
            raise
        return _Batch(conn, transaction, marking, messages, publishing), count

    def _finish(self, batch: _Batch, publisher: _Pipelined) -> None:
        """Mark a batch whose every message has an outcome, and commit it."""
        try:
            published = self._mark(
                batch.conn, batch.marking, batch.publishing.results(), batch.messages
            )
            publisher.pump(0)
            batch.transaction.commit()
        finally:
            batch.conn.close()
        self._committed(published, batch.messages)

    def _claim(self, conn: Connection) -> tuple[list[RowMapping], int]:
        """The rows to publish now, and how many rows the claim took (expired ones included).

        Rows whose time to live ran out are marked expired instead.
        """
        s = self._settings
        rows = queries.claim_outbox(conn, self._tables, s.relay_batch_size)
        if not rows:
            return [], 0
        rows = self._key_prefixes(conn, rows)
        if not rows:
            return [], 0
        expired = [r["id"] for r in rows if _expired(r)]
        if expired:
            queries.mark_expired(conn, self._tables, expired)
            log.warning("relay: %d messages expired before they were published", len(expired))
            self.expired += len(expired)
            rows = [r for r in rows if not _expired(r)]
        return rows, len(rows) + len(expired)

    def _mark(
        self,
        conn: Connection,
        marking: _Marking,
        outcomes: Sequence[PublishOutcome],
        messages: list[OutgoingMessage],
    ) -> list[int]:
        """Mark the published rows, count a failed attempt on the others; return the former.

        `messages` are the batch's messages for the listener (empty without one).
        """
        call(self._listener, "relay_confirmed", messages, outcomes)
        published: list[int] = []
        failed: dict[str, list[tuple[int, int]]] = {}
        for row_id, kind, attempts, outcome in zip(
            marking.ids, marking.kinds, marking.attempts, outcomes, strict=True
        ):
            if outcome is PublishOutcome.CONFIRMED or (
                outcome is PublishOutcome.RETURNED and kind != COMMAND
            ):
                published.append(row_id)
            else:
                reason = (
                    "unroutable: no queue is bound for this command"
                    if outcome is PublishOutcome.RETURNED
                    else f"publish {outcome.value}"
                )
                failed.setdefault(reason, []).append((row_id, attempts))
        queries.mark_published(conn, self._tables, published)
        for reason, items in failed.items():
            for attempts, ids in _group_by_attempts(items).items():
                queries.mark_publish_failed(
                    conn, self._tables, ids, reason, self._retry_delay(attempts)
                )
        if failed:
            log.warning(
                "relay: %d of %d messages not confirmed, kept for retry",
                sum(len(v) for v in failed.values()),
                len(outcomes),
                extra={"reasons": sorted(failed)},
            )
        return published

    def _committed(self, published: list[int], messages: list[OutgoingMessage]) -> None:
        self.published += len(published)
        if self._listener is not None:
            done = set(published)
            call(self._listener, "relay_committed", [m for m in messages if m.id in done])

    def _key_prefixes(self, conn: Connection, rows: list[RowMapping]) -> list[RowMapping]:
        """Drop the claimed rows of any key whose earliest unsent row this claim does not hold.

        See `queries.claim_outbox`: the rows of a key are published only from the first one on;
        otherwise they stay for a later claim, and this relay's key lock keeps others away
        until it commits.
        """
        first: dict[str, int] = {}
        for row in rows:
            key = row["key"]
            if key is not None and key not in first:
                first[key] = row["id"]
        if not first:
            return rows
        earliest = queries.earliest_unsent(conn, self._tables, list(first))
        skipped = {key for key, row_id in first.items() if earliest.get(key) != row_id}
        if not skipped:
            return rows
        log.debug("relay: %d keys left for a later claim (earlier rows unclaimed)", len(skipped))
        return [row for row in rows if row["key"] is None or row["key"] not in skipped]

    def _retry_delay(self, attempts: int) -> timedelta:
        s = self._settings
        return timedelta(seconds=min(s.relay_retry_initial * 2**attempts, s.relay_retry_max))

    def _ensure_publisher(self) -> Publisher:
        if self._publisher is None or self._publisher.broken:
            self._drop_publisher()
            self._publisher = self._broker.publisher()
        return self._publisher

    def _drop_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


#: Batches a relay keeps open at once: one being confirmed, the next going out as the window
#: frees, and a third being claimed and encoded meanwhile.
_PIPELINE_DEPTH = 3
#: How long one pump of the publisher waits for confirms when it has nothing to send.
_PUMP_WAIT = 0.002
#: Messages encoded between two pumps of the publisher while a batch is being prepared.
_PUMP_EVERY = 64


class _Publishing(Protocol):
    """A batch a `_Pipelined` publisher is working on."""

    @property
    def done(self) -> bool: ...

    def results(self) -> list[PublishOutcome]: ...


@runtime_checkable
class _Pipelined(Protocol):
    """A publisher that can keep several batches going (`RabbitMQPublisher` can)."""

    @property
    def broken(self) -> bool: ...

    def start_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> _Publishing: ...

    def pump(self, wait: float) -> None: ...


class _Marking:
    """What marking a batch needs of its rows, in their order: id, kind, attempts so far."""

    __slots__ = ("attempts", "ids", "kinds")

    def __init__(self, ids: list[int], kinds: list[str], attempts: list[int]) -> None:
        self.ids = ids
        self.kinds = kinds
        self.attempts = attempts

    @classmethod
    def of(cls, rows: Sequence[RowMapping]) -> _Marking:
        return cls(
            [row["id"] for row in rows],
            [row["kind"] for row in rows],
            [row["attempts"] for row in rows],
        )


class _Batch:
    """Claimed rows being published, with the transaction that holds them."""

    __slots__ = ("conn", "marking", "messages", "publishing", "transaction")

    def __init__(
        self,
        conn: Connection,
        transaction: RootTransaction,
        marking: _Marking,
        messages: list[OutgoingMessage],
        publishing: _Publishing,
    ) -> None:
        self.conn = conn
        self.transaction = transaction
        self.marking = marking
        self.messages = messages  # for the listener; empty without one
        self.publishing = publishing

    def abort(self) -> None:
        """Roll the claim back: the rows stay unpublished for a later claim."""
        try:
            self.conn.close()
        except Exception as exc:  # the caller is already failing: keep its error
            log.debug("relay: closing a batch's connection failed: %s", _short(exc))


def _expired(row: RowMapping) -> bool:
    expires_at = row["expires_at"]
    return expires_at is not None and bool(expires_at <= row["claimed_at"])


def _group_by_attempts(items: list[tuple[int, int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row_id, attempts in items:
        groups.setdefault(attempts, []).append(row_id)
    return groups


def _short(exc: Any) -> str:
    """First line of a driver error, which may otherwise carry a whole statement."""
    return str(exc).splitlines()[0] if str(exc) else repr(exc)
