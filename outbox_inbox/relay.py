"""The relay: publishes committed outbox rows to the broker and marks them after the confirm."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import SQLAlchemyError

from .broker import Broker, Publisher, PublishOutcome, Refusal
from .config import Settings
from .errors import BrokerError, first_line
from .fingerprint import refusal_fingerprint
from .listener import Listener, call
from .messages import COMMAND, OutgoingMessage, WireMessage, from_row, to_wire
from .queries import roles
from .queries.roles import Claimed
from .role_loop import RoleLoop
from .tables import Tables
from .tracing import Tracing, record_sends
from .waker import Waker

log = logging.getLogger(__name__)

_PUBLISHED = (PublishOutcome.CONFIRMED, PublishOutcome.RETURNED)
#: What a batch's messages are when the broker closed the channel over one of them.
_IN_DOUBT = (PublishOutcome.REFUSED, PublishOutcome.SKIPPED)
#: A refusal whose reason the publisher could not tell (not a refusal of the message itself).
_UNKNOWN_REFUSAL = Refusal(0, "the broker closed the channel")
#: The dead_reason of an outbox row the broker refused on its every attempt.
REFUSED_REASON = "refused"


def outgoing(row: Mapping[Any, Any], source: str) -> OutgoingMessage:
    """The message an outbox row carries."""
    return from_row(OutgoingMessage, row, source=source, attempt=row["attempts"] + 1)


class Relay:
    """Moves outbox rows to the broker. Run one or several, in threads or processes.

    Each batch is one database transaction: claim rows (``FOR UPDATE SKIP LOCKED``), publish
    them with confirms, mark the confirmed ones published, count a failed attempt on the rest,
    commit. A crash anywhere before the commit leaves the rows unpublished, so they are sent
    again and the receiving inbox drops the copy. A returned event (no queue subscribes to
    it) counts as published; a returned command does not.

    A message the broker refuses by closing the channel cannot stop the others (`_isolate`;
    docs/failures.md); it is dead after ``relay_max_attempts``. `run` keeps up to three
    batches open at once, each in its own transaction (`_relay_stream`)."""

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
        tracing: Tracing | None = None,
    ) -> None:
        self._service, self._listener = service, listener
        self._tracing = tracing or Tracing(service)
        self._engine, self._tables, self._broker, self._settings = engine, tables, broker, settings
        self._waker_factory = waker_factory
        self._publisher: Publisher | None = None
        self.published = 0  # messages marked published by this relay (for tests and status)
        self.expired = 0  # messages marked expired instead
        self.dead = 0  # messages marked dead: refused by the broker on every attempt
        # The broker's largest accepted body, once known (probed at start, or named by a
        # refusal): a larger message is refused here without being sent.
        self._max_body: int | None = None
        self._limit_probed = False

    def run(self, stop: threading.Event, *, on_started: Callable[[], None] | None = None) -> None:
        """Relay batches until `stop` is set; the batch in hand is finished first. Waits between
        batches, outages and their log lines are the `RoleLoop`'s; while idle, the publisher goes
        back to the broker's pool, for another relay thread to use."""
        loop = RoleLoop(
            f"relay of {self._service}",
            self._settings,
            log,
            full=self._settings.relay_batch_size,
            poll_interval=self._settings.relay_poll_interval,
            waker_factory=self._waker_factory,
        )
        if on_started:
            on_started()
        try:
            loop.run(stop, lambda: self._relay_stream(stop), recover=self._recover, idle=self._idle)
        finally:
            self._drop_publisher()

    def _recover(self, exc: Exception) -> None:
        if isinstance(exc, BrokerError):
            self._drop_publisher()

    def _idle(self) -> None:
        self._drop_publisher()  # the next batch checks one out again, its heartbeats serviced

    def relay_once(self) -> int:
        """Relay one batch; return how many rows were claimed."""
        s = self._settings
        with self._engine.connect() as conn, conn.begin():
            rows, count = self._claim(conn)
            if not rows:
                return count
            publisher = self._ensure_publisher()
            messages = [outgoing(row, self._service) for row in rows]
            wires = [to_wire(m) for m in messages]
            rows, wires, messages = self._without_oversized(conn, rows, wires, messages)
            started = time.time_ns()
            outcomes = publisher.publish_batch(
                wires, window=s.publish_window, timeout=s.confirm_timeout
            )
            marking = _Marking.of(rows)
            published = self._settle(conn, marking, outcomes, messages, publisher, started)
        self._committed(published, messages)
        self._check_publisher(publisher)
        return count

    def _relay_stream(self, stop: threading.Event) -> int:
        """Relay batches back to back, each in its own transaction, until the backlog is gone. While
        the broker confirms one batch, the next ones are claimed on other connections (up to
        `_PIPELINE_DEPTH` batches open at once) and their messages go out as the confirms free room
        in the window, so the broker is not left idle while the relay claims, encodes, marks and
        commits. A batch is marked and committed once all its confirms are in, in claim order. The
        open transactions hold their rows and keys exactly as several relays would, so nothing
        changes for ordering: a later claim skips the rows and keys an earlier one holds. Without a
        publisher that can keep batches going, or on SQLite (one writing transaction at a time),
        this is `relay_once`. Returns the row count of the last claim; stops claiming once `stop` is
        set, and always finishes the batches in hand first."""
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
        self._check_publisher(publisher)
        return count

    def _open_batch(self, publisher: _Pipelined) -> tuple[_Batch | None, int]:
        """Claim a batch in a new transaction and start publishing it. Returns the batch (None when
        no row is to be published, the transaction then being committed) and the claimed row count,
        as `relay_once` counts it."""
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
            # (the rows, payloads and messages too if a listener or a tracer is to see
            # them): objects that outlive a few collections make the garbage collector's
            # full passes frequent and long.
            traced = self._tracing.tracer() is not None
            keep = self._listener is not None or traced
            messages: list[OutgoingMessage] = []
            wires: list[WireMessage] = []
            for n, row in enumerate(rows, 1):
                message = outgoing(row, self._service)
                wires.append(to_wire(message))
                if keep:
                    messages.append(message)
                if not n % _PUMP_EVERY:
                    publisher.pump(0)
            rows, wires, messages = self._without_oversized(conn, rows, wires, messages)
            if not rows:
                transaction.commit()
                conn.close()
                return None, count
            marking = _Marking.of(rows)
            started = time.time_ns() if traced else 0
            publishing = publisher.start_batch(
                wires, window=s.publish_window, timeout=s.confirm_timeout
            )
        except BaseException:
            conn.close()  # rolls the claim back
            raise
        return _Batch(conn, transaction, marking, messages, publishing, started), count

    def _finish(self, batch: _Batch, publisher: _Pipelined) -> None:
        """Mark a batch whose every message has an outcome, and commit it."""
        try:
            published = self._settle(
                batch.conn,
                batch.marking,
                batch.publishing.results(),
                batch.messages,
                publisher,
                batch.started,
            )
            publisher.pump(0)
            batch.transaction.commit()
        finally:
            batch.conn.close()
        self._committed(published, batch.messages)

    def _claim(self, conn: Connection) -> tuple[list[Claimed], int]:
        """The rows to publish now, and how many rows the claim took (expired ones included). Rows
        whose time to live ran out are marked expired instead. The claim's row locks are bounded
        first: cut off, the session must not keep them past the partition (`roles.bound_on_server`);
        the transaction commits without a disk flush, as a mark a server crash undoes only publishes
        its rows again (`roles.bound_on_server`)."""
        roles.bound_on_server(conn, flush_wait=False)
        claimed = roles.claim_outbox(conn, self._tables, self._settings.relay_batch_size)
        rows = self._key_prefixes(conn, claimed)  # no statement for a claim without keys
        expired = [r["id"] for r in rows if _expired(r)]
        if expired:
            roles.mark_expired(conn, self._tables, expired)
            log.warning("relay: %d messages expired before they were published", len(expired))
            self.expired += len(expired)
            rows = [r for r in rows if not _expired(r)]
        return rows, len(rows) + len(expired)

    def _settle(
        self,
        conn: Connection,
        marking: _Marking,
        outcomes: Sequence[PublishOutcome],
        messages: list[OutgoingMessage],
        publisher: Publisher | _Pipelined,
        started_ns: int,
    ) -> list[int]:
        """Mark a batch whose every message has an outcome; return the published row ids. If the
        broker closed the channel over one of them, the messages in doubt are first published alone
        to find it (`_isolate`). With tracing on, each message gets its ``send`` span, from
        `started_ns` (when the batch went out) to its final outcome."""
        refusals: dict[int, Refusal] = {}
        if PublishOutcome.REFUSED in outcomes:
            refusal = publisher.refusal or _UNKNOWN_REFUSAL
            outcomes, refusals = self._isolate(conn, marking, outcomes, refusal)
        tracer = self._tracing.tracer()
        if tracer is not None and messages:
            record_sends(tracer, self._service, messages, outcomes, started_ns or time.time_ns())
        call(self._listener, "relay_confirmed", messages, outcomes)
        return self._mark(conn, marking, outcomes, refusals)

    def _isolate(
        self,
        conn: Connection,
        marking: _Marking,
        outcomes: Sequence[PublishOutcome],
        refusal: Refusal,
    ) -> tuple[list[PublishOutcome], dict[int, Refusal]]:
        """Publish the messages in doubt of a refused batch one by one; return their outcomes. The
        broker closed the channel over one message without saying which: the unconfirmed (REFUSED)
        and unsent (SKIPPED) ones are published again, alone, in id order, under the batch's row
        locks (docs/failures.md). A key whose message failed keeps its later ones SKIPPED; a
        destination refused (missing exchange, no permission) is not tried again for the rest; a
        lost connection leaves the rest unsent for the next batch."""
        self._learn_limit(refusal.max_body)
        result = list(outcomes)
        refusals: dict[int, Refusal] = {}
        doubt = [i for i, o in enumerate(outcomes) if o in _IN_DOUBT]
        log.warning(
            "relay: %s; publishing the %d messages in doubt one by one", refusal, len(doubt)
        )
        rows = roles.claimed_outbox_rows(conn, self._tables, [marking.ids[i] for i in doubt])
        failed_keys: set[str] = set()
        closed: dict[str, Refusal] = {}  # exchanges refused as a destination
        lost = False  # the connection failed: the rest stay unsent
        for index in doubt:
            row = rows[marking.ids[index]]
            key = row["key"]
            if lost or (key is not None and key in failed_keys):
                result[index] = PublishOutcome.SKIPPED
                continue
            if row["exchange"] in closed:
                result[index], refusals[index] = PublishOutcome.REFUSED, closed[row["exchange"]]
                continue
            wire = to_wire(outgoing(row, self._service))
            outcome, why = self._publish_alone(wire)
            result[index] = outcome
            if why is not None:
                refusals[index] = why
                if not why.message_specific:
                    closed[row["exchange"]] = why
            elif outcome not in _PUBLISHED:
                lost = outcome is PublishOutcome.FAILED
            if outcome not in _PUBLISHED and key is not None:
                failed_keys.add(key)
        return result, refusals

    def _publish_alone(self, wire: WireMessage) -> tuple[PublishOutcome, Refusal | None]:
        """Publish one message with nothing else in flight; a refusal is then its own."""
        too_large = self._too_large(wire)
        if too_large is not None:
            return PublishOutcome.REFUSED, too_large
        s = self._settings
        try:
            publisher = self._ensure_publisher()
        except BrokerError as exc:
            log.warning("relay: cannot publish the messages in doubt: %s", exc)
            return PublishOutcome.FAILED, None
        [outcome] = publisher.publish_batch([wire], window=1, timeout=s.confirm_timeout)
        if outcome is PublishOutcome.REFUSED:
            why = publisher.refusal or _UNKNOWN_REFUSAL
            self._learn_limit(why.max_body)
            return outcome, why
        return outcome, None

    def _without_oversized(
        self,
        conn: Connection,
        rows: list[Claimed],
        wires: list[WireMessage],
        messages: list[OutgoingMessage],
    ) -> tuple[list[Claimed], list[WireMessage], list[OutgoingMessage]]:
        """Take the messages larger than the broker accepts out of a batch, marked refused. Only
        once the broker's limit is known (`_learn_limit`). The later messages of a key whose message
        was refused leave the batch too, unmarked: they wait for that one. `messages` may be empty
        (no listener); else it is filtered alike."""
        if self._max_body is None or not any(len(w.body) > self._max_body for w in wires):
            return rows, wires, messages
        kept = []
        refused: dict[int, Refusal] = {}
        failed_keys: set[str] = set()
        for index, (row, wire) in enumerate(zip(rows, wires, strict=True)):
            key = row["key"]
            if key is not None and key in failed_keys:
                continue
            why = self._too_large(wire)
            if why is None:
                kept.append(index)
                continue
            refused[index] = why
            if key is not None:
                failed_keys.add(key)
        marking = _Marking.of([rows[i] for i in refused])
        outcomes = [PublishOutcome.REFUSED] * len(refused)
        self._mark(conn, marking, outcomes, dict(enumerate(refused.values())))
        return (
            [rows[i] for i in kept],
            [wires[i] for i in kept],
            [messages[i] for i in kept] if messages else messages,
        )

    def _too_large(self, wire: WireMessage) -> Refusal | None:
        limit = self._max_body
        size = len(wire.body)
        if limit is None or size <= limit:
            return None
        return Refusal(
            406,
            f"PRECONDITION_FAILED - message size {size} is larger than the broker's max size "
            f"{limit} (not sent: the broker refused such a message before)",
            limit,
        )

    def _learn_limit(self, max_body: int | None) -> None:
        """Remember the broker's largest accepted body; say so if it is below max_payload_bytes."""
        if max_body is None or max_body == self._max_body:
            return
        self._max_body = max_body
        allowed = self._settings.max_payload_bytes
        if max_body < allowed:
            log.error(
                "relay of %s: the broker accepts message bodies of at most %d bytes "
                "(RabbitMQ's max_message_size), less than max_payload_bytes=%d: a larger "
                "message is refused and ends dead in the outbox after relay_max_attempts; "
                "lower max_payload_bytes or raise the broker's limit",
                self._service,
                max_body,
                allowed,
            )

    def _probe_limit(self) -> None:
        """Ask the broker whether it accepts bodies of max_payload_bytes (advisory). Asked at the
        first connection and again after a connection failed; a refusal in between teaches the limit
        too (`_learn_limit`)."""
        if self._limit_probed:
            return
        try:
            limit = self._broker.body_limit(self._settings.max_payload_bytes)
        except BrokerError as exc:
            log.debug("relay: the broker's message size limit is unknown: %s", exc)
            return
        self._limit_probed = True
        if limit is None and self._max_body is not None:
            log.info("relay of %s: the broker accepts max_payload_bytes again", self._service)
            self._max_body = None
        self._learn_limit(limit)

    def _mark(
        self,
        conn: Connection,
        marking: _Marking,
        outcomes: Sequence[PublishOutcome],
        refusals: Mapping[int, Refusal],
    ) -> list[int]:
        """Mark the published rows, count a failed attempt on the others; return the former.
        `refusals` are the broker's reasons for the REFUSED ones, by index. A row the broker refused
        by itself is dead at its `relay_max_attempts`-th attempt; nothing else kills a row. SKIPPED
        rows were not tried: they are left as they are."""
        published: list[int] = []
        failed: dict[tuple[str, int], list[int]] = {}  # by (reason, attempts)
        dead: dict[tuple[str, str], list[int]] = {}  # by (error, fingerprint)
        for index, (row_id, kind, attempts, outcome) in enumerate(
            zip(marking.ids, marking.kinds, marking.attempts, outcomes, strict=True)
        ):
            if outcome is PublishOutcome.CONFIRMED or (
                outcome is PublishOutcome.RETURNED and kind != COMMAND
            ):
                published.append(row_id)
            elif outcome is PublishOutcome.SKIPPED:
                continue
            elif outcome is PublishOutcome.REFUSED:
                why = refusals.get(index) or _UNKNOWN_REFUSAL
                if why.message_specific and attempts + 1 >= self._settings.relay_max_attempts:
                    dead.setdefault((str(why), refusal_fingerprint(why)), []).append(row_id)
                else:
                    failed.setdefault((str(why), attempts), []).append(row_id)
            else:
                reason = (
                    "unroutable: no queue is bound for this command"
                    if outcome is PublishOutcome.RETURNED
                    else f"publish {outcome.value}"
                )
                failed.setdefault((reason, attempts), []).append(row_id)
        roles.mark_published(conn, self._tables, published)
        for (reason, attempts), ids in failed.items():
            roles.mark_publish_failed(conn, self._tables, ids, reason, self._retry_delay(attempts))
        for (error, cause), ids in dead.items():
            roles.mark_outbox_dead(
                conn, self._tables, ids, REFUSED_REASON, error, fingerprint=cause
            )
            self.dead += len(ids)
            call(self._listener, "dead", REFUSED_REASON, len(ids))
            log.error(
                "relay: %d messages dead after %d attempts: %s",
                len(ids),
                self._settings.relay_max_attempts,
                error,
            )
        if failed:
            counts: dict[str, int] = {}  # by reason, whatever the attempts
            for (reason, _), ids in sorted(failed.items()):
                counts[reason] = counts.get(reason, 0) + len(ids)
            log.warning(
                "relay: %d of %d messages not confirmed, kept for retry (%s)",
                sum(counts.values()),
                len(outcomes),
                "; ".join(f"{n} {reason}" for reason, n in counts.items()),
            )
        return published

    def _check_publisher(self, used: Publisher | _Pipelined) -> None:
        """Drop a broken publisher after batches; raise BrokerError if its connection failed. A
        publisher broken by a refusal was dealt with (the refused message was isolated): the next
        batch simply opens another one."""
        lost = used.broken and used.refusal is None
        current = self._publisher
        if current is not None and current.broken:
            lost = lost or current.refusal is None
            self._drop_publisher()
        if lost:
            raise BrokerError("publishing connection broke during the batch")

    def _committed(self, published: list[int], messages: list[OutgoingMessage]) -> None:
        self.published += len(published)
        if self._listener is not None:
            done = set(published)
            call(self._listener, "relay_committed", [m for m in messages if m.id in done])

    def _key_prefixes(self, conn: Connection, rows: list[Claimed]) -> list[Claimed]:
        """Drop the claimed rows of any key whose earliest unsent row this claim does not hold. See
        `roles.claim_outbox`: the rows of a key are published only from the first one on; otherwise
        they stay for a later claim, and this relay's key lock keeps others away until it
        commits."""
        first: dict[str, int] = {}
        for row in rows:
            key = row["key"]
            if key is not None and key not in first:
                first[key] = row["id"]
        if not first:
            return rows
        earliest = roles.earliest_unsent(conn, self._tables, list(first))
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
            if getattr(self._publisher, "fresh", False):  # a pool's new connection, maybe to a
                self._limit_probed = False  # broker restarted with another limit: asked again
                setattr(self._publisher, "fresh", False)  # noqa: B010 - not every Publisher
            self._probe_limit()
        return self._publisher

    def _drop_publisher(self) -> None:
        if self._publisher is not None:
            if self._publisher.broken and self._publisher.refusal is None:
                # The connection failed: the next one may reach a broker with other settings
                # (restarted with a new max_message_size), so the limit is asked again.
                self._limit_probed = False
            self._publisher.close()
            self._publisher = None


#: Batches a relay keeps open at once: one being confirmed, the next going out as the window
#: frees, and a third being claimed and encoded meanwhile.
_PIPELINE_DEPTH = 3
#: Longest wait of one pump of the publisher for confirms when it has nothing to send (a
#: confirm ends the wait at once).
_PUMP_WAIT = 0.05
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

    @property
    def refusal(self) -> Refusal | None: ...

    def start_batch(
        self, messages: Sequence[WireMessage], *, window: int, timeout: float
    ) -> _Publishing: ...

    def pump(self, wait: float) -> None: ...


@dataclass(slots=True, eq=False)
class _Marking:
    """What marking a batch needs of its rows, in their order: id, kind, attempts so far."""

    ids: list[int]
    kinds: list[str]
    attempts: list[int]

    @classmethod
    def of(cls, rows: Sequence[Claimed]) -> _Marking:
        return cls(
            [row["id"] for row in rows],
            [row["kind"] for row in rows],
            [row["attempts"] for row in rows],
        )


@dataclass(slots=True, eq=False)
class _Batch:
    """Claimed rows being published, with the transaction that holds them."""

    conn: Connection
    transaction: RootTransaction
    marking: _Marking
    messages: list[OutgoingMessage]  # for the listener and the tracer; empty without them
    publishing: _Publishing
    started: int  # time.time_ns() when it went out, if traced; else 0

    def abort(self) -> None:
        """Roll the claim back: the rows stay unpublished for a later claim."""
        try:
            self.conn.close()
        except Exception as exc:  # the caller is already failing: keep its error
            log.debug("relay: closing a batch's connection failed: %s", first_line(exc))


def _expired(row: Claimed) -> bool:
    expires_at = row["expires_at"]
    return expires_at is not None and bool(expires_at <= row["claimed_at"])
