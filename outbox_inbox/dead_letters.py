"""Dead letters: dead inbox and outbox rows and the messages in the broker's dead-letter queues. The
four sources (``table``, ``outbox``, ``queue``, ``unroutable``) are those of `outbox-inbox
dead-letters` (docs/cli.md, "Sources"). A selection is made first (and can be shown), then acted on:
exactly what was selected (`TableSelection`, `OutboxSelection`, `QueueSelection`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, Table
from sqlalchemy.exc import SQLAlchemyError

from .audit_trail import audit_log_path, write_audit
from .broker import Broker, Operator, QueuedMessage, QueueReader
from .clock import as_timedelta, parse_duration
from .config import Settings
from .errors import ConfigurationError, storage_error
from .logsafe import mask_url
from .messages import (
    COMMANDS_EXCHANGE,
    H_CREATED,
    H_DEAD_FINGERPRINT,
    H_DEAD_QUEUE,
    H_DEAD_REASON,
    H_LAST_ERROR,
    H_ORIGINAL_EXCHANGE,
    H_ORIGINAL_ROUTING_KEY,
    H_RECEIVE_ATTEMPT,
    H_RETRY_DELAY,
    H_TENANT,
    TRANSPORT_HEADERS,
    WireMessage,
    _int,
    _text,
    from_row,
    inbox_id,
    jsonable,
)
from .queries import operations
from .tables import Tables
from .topology import (
    DEAD_LETTER_EXCHANGE,
    UNROUTABLE_EXCHANGE,
    UNROUTABLE_QUEUE,
    dead_letter_queue,
    inbox_queue,
    topic_matches,
)

log = logging.getLogger(__name__)

TABLE, OUTBOX, QUEUE, UNROUTABLE = "table", "outbox", "queue", "unroutable"
SOURCES = (TABLE, OUTBOX, QUEUE, UNROUTABLE)

#: Headers a replayed message loses: they describe its failure, not the message. The
#: ``x-original-*`` headers stay, so the receiver restores the original routing key.
FAILURE_HEADERS = frozenset(
    {H_DEAD_REASON, H_DEAD_QUEUE, H_RECEIVE_ATTEMPT, H_RETRY_DELAY, H_LAST_ERROR}
) | (TRANSPORT_HEADERS - {H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY})

Progress = Callable[[int], None]


def parse_message_id(value: str) -> str:
    """A message id as given: a UUID is normalized, anything else kept (foreign senders)."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return value


class FilterError(ConfigurationError):
    """A filter the user gave that does not read; `flag` names it (`FilterField.flag`)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class FilterField:
    """One field of `Filters` as users give it: the CLI's ``--<flag>``, and the dashboard's
    form field `key` when it has an `example` to show. `parse` reads one text (None: kept
    as text); `many`: repeatable (comma-separated on the form); `switch`: takes no value."""

    name: str
    flag: str
    metavar: str
    help: str
    example: str | None = None
    parse: Callable[[str], Any] | None = None
    many: bool = False
    switch: bool = False

    @property
    def key(self) -> str:
        return self.flag.replace("-", "_")


#: Every filter, in the order the CLI's help and the dashboard's form list them: what the
#: CLI's options, the form and `Filters.read` are built from.
FILTER_FIELDS = (
    FilterField(
        "types",
        "type",
        "PATTERN",
        "Message type: a routing key or topic pattern (orders.#). Repeatable.",
        "orders.#",
        many=True,
    ),
    FilterField(
        "reason",
        "reason",
        "REASON",
        "Dead reason: max_attempts, rejected, invalid_payload, payload_missing, no_handler,"
        " expired, abandoned, interrupted (table); refused (outbox); invalid, store_failed,"
        " redelivered, or the broker's rejected / expired / delivery_limit (queue).",
        "rejected",
    ),
    FilterField(
        "error", "error", "TEXT", "Text in the error (case-insensitive).", "text in the error"
    ),
    FilterField(
        "older_than",
        "older-than",
        "DURATION",
        "Dead for at least this long (30m, 2h, 7d).",
        "30m",
        parse=parse_duration,
    ),
    FilterField(
        "message_ids", "id", "MESSAGE_ID", "A message id. Repeatable.", None, parse_message_id, True
    ),
    FilterField(
        "fingerprint",
        "group",
        "GROUP",
        "One dead-letter group: its ID as `groups` prints it, or its fingerprint.",
    ),
    FilterField(
        "parked",
        "parked",
        "",
        "The parked rows instead of the dead ones (table and outbox sources).",
        switch=True,
    ),
)


@dataclass(frozen=True)
class Filters:
    """What to select. Every given filter must match; none given selects everything.
    `FilterError` for a type that is not a routing key or pattern (`is_pattern`)."""

    types: tuple[str, ...] = ()  # topic patterns (`orders.#`) or exact routing keys
    older_than: timedelta | None = None  # dead for at least this long
    reason: str | None = None  # the reason word: max_attempts, rejected, invalid, ...
    error: str | None = None  # case-insensitive substring of the error text
    message_ids: tuple[str, ...] = ()
    fingerprint: str | None = None  # one dead-letter group: see DeadLetters.groups
    parked: bool = False  # the parked rows instead of the dead ones (table and outbox)

    def __post_init__(self) -> None:
        for pattern in self.types:
            if not self.is_pattern(pattern):
                raise FilterError("type", f"{pattern!r} is not a routing key or pattern")

    @classmethod
    def read(cls, given: Mapping[str, Any]) -> Filters:
        """The filters a user gave as text, by `FilterField.name`: a text, several texts
        (`many`), or a bool (`switch`); a missing or blank text is not given. `FilterError`
        names the filter that does not read."""
        values: dict[str, Any] = {}
        for f in FILTER_FIELDS:
            raw = given.get(f.name)
            if f.switch:
                values[f.name] = bool(raw)
                continue
            texts = [t.strip() for t in ((raw or ()) if f.many else (raw or "",)) if t.strip()]
            try:
                read = [f.parse(t) if f.parse else t for t in texts]
            except ValueError as exc:
                raise FilterError(f.flag, str(exc)) from exc
            values[f.name] = tuple(read) if f.many else next(iter(read), None)
        return cls(**values)

    @staticmethod
    def is_pattern(pattern: str) -> bool:
        """True for dot-separated words: a routing key or a topic pattern (``orders.#``)."""
        return bool(pattern) and all(pattern.split("."))

    @property
    def empty(self) -> bool:
        return not self.as_dict()

    def as_dict(self) -> dict[str, Any]:
        """The filters given, as JSON values (for output and the audit log)."""
        given = {
            "type": list(self.types) or None,
            "older_than_seconds": None
            if self.older_than is None
            else self.older_than.total_seconds(),
            "reason": self.reason,
            "error": self.error,
            "id": list(self.message_ids) or None,
            "fingerprint": self.fingerprint,
            "parked": self.parked or None,
        }
        return {name: value for name, value in given.items() if value is not None}

    def matches_type(self, routing_key: str) -> bool:
        return not self.types or any(topic_matches(p, routing_key) for p in self.types)

    def matches(self, letter: DeadLetter) -> bool:
        age = letter.age_seconds
        return (
            self.matches_type(letter.type)
            and (not self.message_ids or letter.message_id in self.message_ids)
            and self.reason in (None, letter.reason)
            and self.fingerprint in (None, letter.fingerprint)
            and (self.error is None or self.error.lower() in (letter.error or "").lower())
            and (
                self.older_than is None
                or (age is not None and age >= self.older_than.total_seconds())
            )
        )


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, from whichever source, as the operator sees it."""

    source: str
    ref: str  # where it is: the row id, or the position in the queue as read
    message_id: str
    type: str
    reason: str | None
    error: str | None
    dead_at: datetime | None
    age_seconds: float | None
    kind: str | None = None
    key: str | None = None
    attempts: int | None = None
    correlation_id: str | None = None
    payload: Any = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: str | None = None  # why it died, as DeadLetters.groups groups it
    replays: int = 0  # how many times it was replayed (and died again since, being here)
    replayed_at: datetime | None = None  # its last replay
    #: Its first send (queue sources: the message's created header or timestamp).
    created_at: datetime | None = None

    @property
    def reason_shown(self) -> str:
        """The reason and how many replays it died again after, as the CLI and dashboard say."""
        again = f" (after {self.replays} replay{'s' if self.replays > 1 else ''})"
        return (self.reason or "") + (again if self.replays else "")

    def as_dict(self) -> dict[str, Any]:
        """Every field as a JSON value (times in ISO 8601, the payload as read), and `group`."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown: dict[str, Any] = jsonable(fields | {"headers": dict(self.headers), "payload": None})
        age, fingerprint = self.age_seconds, self.fingerprint
        return shown | {
            "payload": self.payload,
            "age_seconds": None if age is None else round(age, 3),
            "group": None if fingerprint is None else group_id(fingerprint),
        }


@dataclass
class Outcome:
    """What an action did to one source's selection."""

    source: str
    selected: int
    done: list[str] = field(default_factory=list)  # message ids replayed or purged
    kept: list[tuple[str, str]] = field(default_factory=list)  # (message id, why)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "selected": self.selected,
            "done": len(self.done),
            "message_ids": self.done,
            "kept": [{"message_id": m, "why": why} for m, why in self.kept],
        }


class Pacer:
    """Keeps an action at most `rate` items per second (no limit when rate is None)."""

    def __init__(self, rate: float | None) -> None:
        self._rate = rate
        self._start = time.monotonic()
        self._sent = 0

    def batch_size(self, largest: int = 100) -> int:
        """Items per step: small enough to spread the work evenly over each second."""
        return max(1, min(largest, int(self._rate / 10))) if self._rate else largest

    def before(self, count: int) -> None:
        """Wait until `count` more items may go."""
        if self._rate and (delay := self._start + self._sent / self._rate - time.monotonic()) > 0:
            time.sleep(delay)
        self._sent += count


class TableSelection:
    """Dead inbox rows matching `filters`, at most `limit`, in id order (arrival order). Replay
    makes them pending again, due now, with fresh counters, and counts itself on each row
    (``replays``, ``replayed_at``); purge deletes them. Acts on rows by id, still dead."""

    source = TABLE
    what = "dead inbox rows"

    def __init__(
        self, engine: Engine, tables: Tables, filters: Filters, limit: int | None = None
    ) -> None:
        self._engine = engine
        self._table = tables.inbox if self.source == TABLE else tables.outbox
        self.letters: list[DeadLetter] = []
        self._ids: list[int] = []
        self.more = False  # True when `limit` cut the selection short
        #: What the action under way has done so far (kept when it fails half-way).
        self.outcome: Outcome | None = None
        self._parked = filters.parked
        self._gone = "no longer parked" if filters.parked else "no longer dead"  # why one is kept
        try:
            with engine.connect() as conn:
                for row in operations.dead_rows(conn, self._table, **self._query(filters)):
                    if not filters.matches_type(row["routing_key"]):
                        continue
                    if limit is not None and len(self.letters) >= limit:
                        self.more = True
                        break
                    self._ids.append(int(row["id"]))
                    self.letters.append(_row_letter(row, self.source))
        except SQLAlchemyError as exc:
            where = engine.url.render_as_string(hide_password=True)
            raise storage_error(exc, f"reading the {self.what} from {where}") from exc

    @classmethod
    def _query(cls, filters: Filters) -> operations.DeadFilters:
        """`filters` as the keywords of the dead-row queries. A topic pattern among the types
        selects every type there: the rows are matched to it one by one."""
        exact = () if any(_is_pattern(t) for t in filters.types) else filters.types
        return operations.DeadFilters(
            routing_keys=exact,
            older_than=filters.older_than,
            reason=filters.reason,
            error=filters.error,
            message_ids=cls._message_ids(filters.message_ids),
            fingerprint=filters.fingerprint,
            parked=filters.parked,
        )

    @staticmethod
    def _message_ids(message_ids: Iterable[str]) -> list[uuid.UUID]:
        # Inbox rows of a message id that is not a UUID are stored under its uuid5.
        return [inbox_id(m) for m in message_ids]

    def _each_batch(
        self,
        action: Callable[[Any, Table, list[int]], list[int]],
        pacer: Pacer,
        progress: Progress,
        why_not: str,
    ) -> Outcome:
        """`action` on the selected rows batch by batch, one transaction each. `outcome`
        gains each batch's rows as it commits, so a failure leaves in it what was done."""
        outcome = self.outcome = Outcome(self.source, len(self._ids))
        letters = dict(zip(self._ids, self.letters, strict=True))
        size = pacer.batch_size()
        for start in range(0, len(self._ids), size):
            batch = self._ids[start : start + size]
            pacer.before(len(batch))
            try:
                with self._engine.begin() as conn:
                    changed = set(action(conn, self._table, batch))
            except SQLAlchemyError as exc:
                raise storage_error(exc, f"changing {self.what}") from exc
            for row_id in batch:
                message_id = letters[row_id].message_id
                if row_id in changed:
                    outcome.done.append(message_id)
                else:
                    outcome.kept.append((message_id, why_not))
            progress(len(batch))
        return outcome

    def replay(self, pacer: Pacer, progress: Progress) -> Outcome:
        """Make the selected rows due again (those still dead, or parked when the selection
        is of parked rows), batch by batch in id order, counting the replay on each."""
        replay = functools.partial(operations.replay_dead, parked=self._parked)
        return self._each_batch(replay, pacer, progress, self._gone)

    def purge(self, pacer: Pacer, progress: Progress) -> Outcome:
        """Delete the selected rows that are still dead (or parked)."""
        purge = functools.partial(operations.purge_dead, parked=self._parked)
        return self._each_batch(purge, pacer, progress, self._gone)

    def park(self, pacer: Pacer, progress: Progress) -> Outcome:
        """Set the selected rows that are still dead aside as parked."""
        return self._each_batch(operations.park_dead, pacer, progress, "not dead")

    def close(self) -> None:
        """Nothing to release: the rows were read in a finished transaction."""


class OutboxSelection(TableSelection):
    """Dead outbox rows (the broker refused them on every attempt) matching `filters`. Replay
    makes them unsent again, due now, with their attempts reset, for the relay's next batch
    (docs/cli.md, "replay"). Purge deletes them."""

    source = OUTBOX
    what = "dead outbox rows"

    @staticmethod
    def _message_ids(message_ids: Iterable[str]) -> list[uuid.UUID]:
        # The outbox writes UUIDs only: a message id that is not one matches no row.
        wanted = list(message_ids)
        found = []
        for message_id in wanted:
            with contextlib.suppress(ValueError):
                found.append(uuid.UUID(message_id))
        if wanted and not found:
            return [uuid.UUID(int=0)]  # ids were given and none can match: select nothing
        return found


def _row_letter(row: Mapping[Any, Any], source: str) -> DeadLetter:
    age = row["age_seconds"]
    return from_row(
        DeadLetter,
        row,
        source=source,
        ref=str(row["id"]),
        message_id=str(row["message_id"]),
        reason=row["dead_reason"],
        error=row["last_error"],
        age_seconds=float(age) if age is not None else None,
        created_at=None,  # of the queue sources only
    )


def _is_pattern(routing_key: str) -> bool:
    return any(word in ("*", "#") for word in routing_key.split("."))


class QueueSelection:
    """Messages of a dead-letter queue matching `filters`, held unacknowledged until `close()`
    returns those not acted on to their place. Reads at most `limit` messages (default: the
    queue's depth at the start, so a message replayed back is not read twice); every message
    read is held, matching or not, so the next read gets the next one."""

    def __init__(
        self,
        admin: Operator,
        source: str,
        filters: Filters,
        *,
        service: str | None,
        limit: int | None = None,
    ) -> None:
        if source == QUEUE and service is None:
            raise ValueError("the queue source needs a service")
        self.queue = _queue(source, service)
        self.source = source
        self._service = service
        self._reader: QueueReader = admin.reader(self.queue)
        self.letters: list[DeadLetter] = []
        self._held: list[QueuedMessage] = []
        self.more = False
        #: What the action under way has done so far (kept when it fails half-way).
        self.outcome: Outcome | None = None
        try:
            depth = self._reader.depth()
            budget = depth if limit is None else min(limit, depth)
            self.more = limit is not None and depth > limit
            now = datetime.now(UTC)
            for position in range(1, budget + 1):
                taken = self._reader.get()
                if taken is None:
                    break
                letter = _queued_letter(taken.message, source, position, now)
                if filters.matches(letter):
                    self._held.append(taken)
                    self.letters.append(letter)
        except BaseException:
            self._reader.close()
            raise

    def replay(self, pacer: Pacer, progress: Progress) -> Outcome:
        """Republish each selected message, in queue order, and ack it once confirmed: a
        ``queue`` message to ``<service>.inbox`` (`replay_headers`), an ``unroutable`` one where
        it was sent."""
        outcome = self.outcome = Outcome(self.source, len(self._held))
        published: dict[str, str] = {}
        for taken, letter in zip(self._held, self.letters, strict=True):
            pacer.before(1)
            exchange, routing_key, headers = self._target(taken.message)
            if self._reader.republish(taken, exchange, routing_key, headers):
                self._reader.ack(taken)
                published[letter.message_id] = routing_key
                outcome.done.append(letter.message_id)
            else:
                outcome.kept.append((letter.message_id, f"unroutable: no queue {routing_key!r}"))
            progress(1)
        if self.source == UNROUTABLE and published:
            self._find_returned(outcome, published)
        return outcome

    def _target(self, message: WireMessage) -> tuple[str, str, dict[str, Any]]:
        if self.source == QUEUE:
            assert self._service is not None
            return "", inbox_queue(self._service), replay_headers(message)
        headers = {k: v for k, v in message.headers.items() if k not in FAILURE_HEADERS}
        exchange = _text(message.headers.get(H_ORIGINAL_EXCHANGE)) or message.exchange
        if exchange in ("", UNROUTABLE_EXCHANGE):
            exchange = COMMANDS_EXCHANGE
        routing_key = _text(message.headers.get(H_ORIGINAL_ROUTING_KEY)) or message.routing_key
        return exchange, routing_key, headers

    def _find_returned(self, outcome: Outcome, published: dict[str, str]) -> None:
        """Find replayed commands that came straight back to the end of `unroutable` (through
        the alternate exchange of `commands`, before the confirm), and leave them there."""
        for _ in range(self._reader.depth()):
            taken = self._reader.get()
            if taken is None:
                break
            self._held.append(taken)  # held, so it goes back on close
            message_id = taken.message.message_id
            if message_id in published and message_id in outcome.done:
                outcome.done.remove(message_id)
                key = published[message_id]
                outcome.kept.append((message_id, f"still unroutable: no queue for {key!r}"))

    def purge(self, pacer: Pacer, progress: Progress) -> Outcome:
        """Acknowledge (remove) each selected message."""
        outcome = self.outcome = Outcome(self.source, len(self._held))
        for taken, letter in zip(self._held, self.letters, strict=True):
            pacer.before(1)
            self._reader.ack(taken)
            outcome.done.append(letter.message_id)
            progress(1)
        return outcome

    def close(self) -> None:
        """Release every message read and not acknowledged back to the queue."""
        self._reader.close()


def _queue(source: str, service: str | None) -> str:
    """The queue of a broker source: ``<service>.dead_letter`` or ``unroutable``."""
    return dead_letter_queue(service or "") if source == QUEUE else UNROUTABLE_QUEUE


def replay_headers(message: WireMessage) -> dict[str, Any]:
    """Headers of the copy of a dead-lettered message sent back to the inbox queue: without the
    failure's transport headers, with the original exchange and routing key (from the broker's
    ``x-death`` record when the broker itself dead-lettered the message)."""
    headers = {k: v for k, v in message.headers.items() if k not in FAILURE_HEADERS}
    death = _first_death(message.headers)
    if H_ORIGINAL_EXCHANGE not in headers:
        exchange = _text(death.get("exchange")) if death else None
        if exchange is None and message.exchange not in ("", DEAD_LETTER_EXCHANGE):
            exchange = message.exchange
        if exchange is not None:
            headers[H_ORIGINAL_EXCHANGE] = exchange
    if H_ORIGINAL_ROUTING_KEY not in headers and (key := _first_key(death)) is not None:
        headers[H_ORIGINAL_ROUTING_KEY] = key
    return headers


def _first_death(headers: Mapping[str, Any]) -> dict[str, Any]:
    deaths = headers.get("x-death")
    if isinstance(deaths, list | tuple) and deaths and isinstance(deaths[0], dict):
        return dict(deaths[0])
    return {}


def _queued_letter(message: WireMessage, source: str, position: int, now: datetime) -> DeadLetter:
    headers = message.headers
    death = _first_death(headers)
    reason_text = _text(headers.get(H_DEAD_REASON))
    if reason_text is None and death:
        reason_text = _text(death.get("reason"))
    reason, _, detail = (reason_text or "").partition(":")
    errors = [part for part in (detail.strip(), _text(headers.get(H_LAST_ERROR))) if part]
    routing_key = (
        message.type
        or _text(headers.get(H_ORIGINAL_ROUTING_KEY))
        or _first_key(death)
        or message.routing_key
    )
    dead_at = death.get("time") if isinstance(death.get("time"), datetime) else None
    created = _created(message)
    since = _aware(dead_at) or created
    return DeadLetter(
        source=source,
        ref=f"#{position}",
        message_id=message.message_id or "",
        type=routing_key,
        reason=reason or (None if source == QUEUE else "unroutable"),
        error="\n".join(errors) or None,
        dead_at=dead_at,
        age_seconds=(now - since).total_seconds() if since is not None else None,
        kind=_text(headers.get("x-kind")),
        key=_text(headers.get("x-key")),
        attempts=_int(headers.get(H_RECEIVE_ATTEMPT)),
        correlation_id=message.correlation_id,
        payload=_payload(message.body),
        headers=dict(headers),
        # Messages dead-lettered before the header existed are grouped by their reason.
        fingerprint=_text(headers.get(H_DEAD_FINGERPRINT))
        or reason
        or ("unknown" if source == QUEUE else "unroutable"),
        created_at=created,
    )


def _first_key(death: Mapping[str, Any]) -> str | None:
    keys = death.get("routing-keys")
    return _text(keys[0]) if isinstance(keys, list | tuple) and keys else None


def _created(message: WireMessage) -> datetime | None:
    value = message.headers.get(H_CREATED)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return _aware(value)
    if message.timestamp:
        return datetime.fromtimestamp(message.timestamp, UTC)
    return None


def _payload(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return body.decode("utf-8", "replace")


def error_summary(text: str | None, width: int = 200) -> str | None:
    """One line of an error text: a traceback's last line (the exception), else the first."""
    if not text:
        return text
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if "Traceback (most recent call last)" in text else lines[0]
    return line[:width]


def _aware(value: Any) -> datetime | None:
    """A time read from the database, with its zone (SQLite gives naive UTC times)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value if isinstance(value, datetime) else None


#: A selection of one source, held until closed (queue messages stay unacknowledged).
Selection = TableSelection | QueueSelection
#: The actions on a selection (park: table and outbox sources only).
REPLAY, PURGE, PARK = "replay", "purge", "park"
ACTIONS = (REPLAY, PURGE, PARK)
#: What each action did, as its report says it.
DONE = {REPLAY: "replayed", PURGE: "purged", PARK: "parked"}


def group_id(fingerprint: str) -> str:
    """A dead-letter group's short id, for a command line: its fingerprint's SHA-256 (8 hex)."""
    return hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True)
class Group:
    """The dead rows of one cause: see `DeadLetters.groups`."""

    fingerprint: str
    count: int
    types: tuple[str, ...]  # their routing keys, sorted
    sources: tuple[str, ...]  # "table" (inbox rows), "outbox"
    first_seen: datetime | None  # the earliest and latest time one of them died
    last_seen: datetime | None
    replayed: int  # how many of them died again after a replay

    @property
    def id(self) -> str:
        """The group's short id (`group_id`)."""
        return group_id(self.fingerprint)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, **jsonable(dataclasses.asdict(self))}


def _listed(value: Any) -> tuple[str, ...]:
    """An aggregated list: a PostgreSQL array, or SQLite's JSON array text."""
    items = json.loads(value) if isinstance(value, str) else value
    return tuple(sorted(str(item) for item in items or () if item is not None))


@dataclass
class DeadLetters:
    """The dead letters of one service, from every source it can reach: the one implementation
    of `outbox-inbox dead-letters` and the dashboard (docs/cli.md, "dead-letters"). Build it
    with `of(service)` or from its parts. `replay`, `purge`, `park` and `run` append an audit
    record to `audit_log=` (else `audit_trail.audit_log_path()`); `act`, the bare step, none."""

    engine: Engine | None = None
    tables: Tables | None = None
    broker: Broker | None = None
    service: str | None = None
    #: The service's retention (Settings.retention), its inbox's duplicate window: a replay of
    #: ``queue`` letters first sent longer ago warns (ActionReport.warnings). None: no warning.
    retention: timedelta | None = field(default_factory=lambda: as_timedelta(Settings.retention))
    #: A tenant's service (`Service.tenant`), where its messages' redelivery counters are.
    tenant: Callable[[str], Any] | None = None

    @classmethod
    def of(cls, service: Any) -> DeadLetters:
        """The dead letters of a `Service` (its database, its broker, its name)."""
        return cls(
            engine=service.engine,
            tables=service.tables,
            broker=service.broker,
            service=service.name,
            retention=as_timedelta(service.settings.retention),
            tenant=service.tenant if service._tenants is not None else None,
        )

    def reachable(self, source: str = "all") -> tuple[list[str], list[tuple[str, str]]]:
        """The sources of `source` (of SOURCES, or "all") that can be read, and those that
        cannot, each with why."""
        wanted = list(SOURCES) if source == "all" else [source]
        if any(name not in SOURCES for name in wanted):
            raise ConfigurationError(f"unknown dead-letter source {source!r}: one of {SOURCES}")
        chosen: list[str] = []
        missing: list[tuple[str, str]] = []
        for name in wanted:
            if name in (TABLE, OUTBOX) and (self.engine is None or self.tables is None):
                missing.append((name, "no database"))
            elif name in (QUEUE, UNROUTABLE) and self.broker is None:
                missing.append((name, "no RabbitMQ broker"))
            elif name == QUEUE and self.service is None:
                missing.append((name, "no service name"))
            else:
                chosen.append(name)
        return chosen, missing

    @contextlib.contextmanager
    def select(
        self, sources: Iterable[str], filters: Filters, limit: int | None = None
    ) -> Iterator[list[Selection]]:
        """One selection per source, at most `limit` letters each; all closed at the end (the
        queue messages read and not acted on go back to their queue, in their place)."""
        with contextlib.ExitStack() as stack:
            admin: Operator | None = None
            selections: list[Selection] = []
            for source in sources:
                selection: Selection
                if filters.parked and source not in (TABLE, OUTBOX):
                    raise ConfigurationError(
                        f"the {source} source has no parked letters: only table and outbox"
                    )
                if source in (TABLE, OUTBOX):
                    if self.engine is None or self.tables is None:
                        raise ConfigurationError(f"the {source} source needs a database")
                    rows = TableSelection if source == TABLE else OutboxSelection
                    selection = rows(self.engine, self.tables, filters, limit)
                else:
                    if self.broker is None:
                        raise ConfigurationError(f"the {source} source needs a broker")
                    if admin is None:
                        admin = stack.enter_context(self.broker.operator())
                    selection = QueueSelection(
                        admin, source, filters, service=self.service, limit=limit
                    )
                stack.callback(selection.close)
                selections.append(selection)
            yield selections

    def count(self, sources: Iterable[str], filters: Filters = Filters()) -> dict[str, int]:
        """How many dead letters of each source match `filters`: rows by one query (or one by
        one for a topic pattern), a broker queue by its depth, or by reading it when filtered."""
        counts: dict[str, int] = {}
        for source in sources:
            if source in (TABLE, OUTBOX) and not any(_is_pattern(t) for t in filters.types):
                counts[source] = self._count_rows(source, filters)
            elif source in (QUEUE, UNROUTABLE) and filters.empty and self.broker is not None:
                counts[source] = self.broker.queue_depth(_queue(source, self.service)) or 0
            else:
                with self.select([source], filters) as [selection]:
                    counts[source] = len(selection.letters)
        return counts

    def _count_rows(self, source: str, filters: Filters) -> int:
        if self.engine is None or self.tables is None:
            raise ConfigurationError(f"the {source} source needs a database")
        selector = TableSelection if source == TABLE else OutboxSelection
        table = self.tables.inbox if source == TABLE else self.tables.outbox
        try:
            with self.engine.connect() as conn:
                return operations.count_dead(conn, table, **selector._query(filters))
        except SQLAlchemyError as exc:
            raise storage_error(exc, f"counting the {selector.what}") from exc

    def groups(self, *, parked: bool = False) -> list[Group]:
        """The dead rows of the table and outbox sources (`parked`: the parked rows) grouped
        by fingerprint, largest first, in one query; the broker queues' letters are not counted,
        though ``Filters(fingerprint=...)`` selects them. StorageError when the database fails."""
        if self.engine is None or self.tables is None:
            raise ConfigurationError("dead-letter groups need a database")
        try:
            with self.engine.connect() as conn:
                rows = operations.dead_groups(conn, self.tables, parked=parked)
        except SQLAlchemyError as exc:
            raise storage_error(exc, "grouping the dead letters") from exc
        return [
            Group(
                fingerprint=row["fingerprint"] or "",
                count=int(row["count"]),
                types=_listed(row["types"]),
                sources=_listed(row["sources"]),
                first_seen=_aware(row["first_seen"]),
                last_seen=_aware(row["last_seen"]),
                replayed=int(row["replayed"]),
            )
            for row in rows
        ]

    def group(self, ref: str, *, parked: bool = False) -> str:
        """The fingerprint of the group `ref` names: its short id (`Group.id`) among
        `groups(parked=parked)`, else `ref` itself, taken as a fingerprint (the queue sources'
        groups are not listed by `groups`)."""
        for found in self.groups(parked=parked):
            if ref == found.id:
                return found.fingerprint
        return ref

    def act(
        self,
        action: str,
        selection: Selection,
        *,
        pacer: Pacer | None = None,
        progress: Progress = lambda _n: None,
    ) -> Outcome:
        """Replay, purge or park every letter of `selection`, writing no audit record (its
        caller does). A ``<service>.dead_letter`` letter has its redelivery counter reset (when a
        database is known) before its replay, so that it does not die again at once."""
        pacer = pacer or Pacer(None)
        if action == PURGE:
            return selection.purge(pacer, progress)
        if action == PARK:
            if not isinstance(selection, TableSelection):
                raise ConfigurationError(f"the {selection.source} source cannot be parked")
            return selection.park(pacer, progress)
        if action != REPLAY:
            raise ConfigurationError(f"unknown action {action!r}: one of {ACTIONS}")
        if isinstance(selection, QueueSelection) and selection.source == QUEUE:
            self._reset_counters(selection.letters)
        return selection.replay(pacer, progress)

    def run(
        self,
        action: str,
        selections: list[Selection],
        *,
        filters: Filters,
        source: str,
        rate: float | None = None,
        progress: Progress = lambda _n: None,
        dry_run: bool = False,
        audit_log: str | os.PathLike[str] | None = None,
        command: str | None = None,
        client: str | None = None,
        mask: Callable[[str], str] = mask_url,
    ) -> ActionReport:
        """Replay, purge or park the open `selections` (selected, shown and confirmed by the
        caller), at most `rate` letters a second, and write the audit record to `audit_log`
        (default `audit_log_path()`) in every case: a dry run, an empty selection, an action that
        fails half-way (with its error, then raised on). `source`, `filters` and `command`
        (default ``dead-letters <action>``) go on the record. OSError when it cannot be written."""
        if action not in ACTIONS:
            raise ConfigurationError(f"unknown action {action!r}: one of {ACTIONS}")
        if audit_log is None:
            audit_log = audit_log_path()
        selected = [letter for s in selections for letter in s.letters]
        report = ActionReport(action, source, selected, dry_run=dry_run)
        if action == REPLAY:
            report.warnings = self._beyond_retention(selected)
        record: dict[str, Any] = {
            "command": command or f"dead-letters {action}",
            "service": self.service,
            "source": source,
            "filters": filters.as_dict(),
            "client": client,
            "mask": mask,
        }
        if dry_run or not selected:
            report.audit = write_audit(
                audit_log,
                **record,
                counts={s.source: len(s.letters) for s in selections},
                message_ids=[d.message_id for d in selected],
                dry_run=dry_run,
            )
            return report
        error: str | None = None
        pacer = Pacer(rate)
        for selection in selections:
            selection.outcome = None
        try:
            for selection in selections:
                report.outcomes.append(self.act(action, selection, pacer=pacer, progress=progress))
        except BaseException as exc:  # recorded, then raised on
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            # What the failed selection did before it failed was done: it goes on record.
            unfinished = selections[len(report.outcomes) :]
            if unfinished and unfinished[0].outcome is not None:
                report.outcomes.append(unfinished[0].outcome)
            raise
        finally:
            report.audit = write_audit(
                audit_log,
                **record,
                counts={o.source: len(o.done) for o in report.outcomes},
                message_ids=[m for o in report.outcomes for m in o.done],
                dry_run=False,
                error=error,
            )
        return report

    def replay(
        self, sources: Iterable[str], filters: Filters, *, limit: int | None = None, **options: Any
    ) -> ActionReport:
        """Select and replay in one call (no one to confirm): see `select` and `run`."""
        return self._select_and_run(REPLAY, sources, filters, limit, options)

    def purge(
        self, sources: Iterable[str], filters: Filters, *, limit: int | None = None, **options: Any
    ) -> ActionReport:
        """Select and purge in one call (no one to confirm): see `select` and `run`."""
        return self._select_and_run(PURGE, sources, filters, limit, options)

    def park(
        self, sources: Iterable[str], filters: Filters, *, limit: int | None = None, **options: Any
    ) -> ActionReport:
        """Select and park in one call: the selected dead rows are set aside (table and
        outbox sources only; ConfigurationError for another). See `select` and `run`."""
        return self._select_and_run(PARK, sources, filters, limit, options)

    def _select_and_run(
        self,
        action: str,
        sources: Iterable[str],
        filters: Filters,
        limit: int | None,
        options: dict[str, Any],
    ) -> ActionReport:
        asked = list(sources)
        with self.select(asked, filters, limit) as selections:
            return self.run(action, selections, filters=filters, source=",".join(asked), **options)

    def _beyond_retention(self, letters: list[DeadLetter]) -> list[str]:
        """The warning of a replay of ``queue`` letters first sent over the retention ago (the
        inbox may have dropped a copy it stored: docs/history.md), judged on this host's clock
        against each message's created time (the broker's messages have no database time)."""
        if self.retention is None:
            return []
        cutoff = datetime.now(UTC) - self.retention
        old = [d for d in letters if d.source == QUEUE and d.created_at and d.created_at < cutoff]
        if not old:
            return []
        days = self.retention.total_seconds() / 86400
        return [
            f"{len(old)} queue dead letter{'' if len(old) == 1 else 's'} first sent more than "
            f"the retention ({days:g} days) ago: a copy stored before may no longer be "
            "recognized and could be handled twice"
        ]

    def _reset_counters(self, letters: list[DeadLetter]) -> None:
        """Forget the redelivery counts of `letters`, each in its tenant's tables (where a
        database is known): replayed copies start at 0. A failure is only warned about."""
        ids: dict[str, list[uuid.UUID]] = {}
        for letter in letters:
            tenant = _text(letter.headers.get(H_TENANT)) if self.tenant else ""
            ids.setdefault(tenant or "", []).append(inbox_id(letter.message_id))
        for tenant, some in ids.items():
            try:
                where = self.tenant(tenant) if tenant and self.tenant else self
                if where.engine is not None and where.tables is not None:
                    with where.engine.begin() as conn:
                        operations.forget_deliveries(conn, where.tables, some)
            except (SQLAlchemyError, ConfigurationError) as exc:
                error = storage_error(exc, "resetting redelivery counters")
                log.warning("redelivery counters not reset before the replay: %s", error)


@dataclass
class ActionReport:
    """What `DeadLetters.run` did: the letters selected, an outcome per source, the record."""

    action: str
    source: str
    selected: list[DeadLetter]
    outcomes: list[Outcome] = field(default_factory=list)
    audit: dict[str, Any] | None = None
    dry_run: bool = False
    #: What the action risks, for the operator (a replay beyond the duplicate window).
    warnings: list[str] = field(default_factory=list)

    @property
    def done(self) -> list[str]:
        """The message ids replayed or purged."""
        return [m for o in self.outcomes for m in o.done]

    @property
    def kept(self) -> list[tuple[str, str]]:
        """(message id, why) of every selected letter left as it was."""
        return [k for o in self.outcomes for k in o.kept]

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "dry_run": self.dry_run,
            "selected": len(self.selected),
            "results": [o.as_dict() for o in self.outcomes],
            "audit": self.audit,
            "warnings": self.warnings,
        }


__all__ = ["DeadLetter", "DeadLetters", "Filters", "Group", "Outcome"]
