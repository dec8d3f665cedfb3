"""Time partitions of the outbox and the inbox on PostgreSQL: made ahead, dropped after the
retention, exported to the archive first when it has a target (docs/history.md, "Retention").
No DEFAULT partition (it would keep a partition from being detached concurrently): they are
made `ahead` of time. The retention is the inbox's duplicate window: `config.duplicate_horizon`."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Table
from sqlalchemy.exc import SQLAlchemyError

from .errors import SchemaMissing, storage_error
from .queries import archive
from .queries import partitions as sql
from .queries.partitions import holds_unfinished, partition_rows
from .tables import Tables

log = logging.getLogger(__name__)

#: The lengths of a partition, by the ``partition_interval`` setting.
INTERVALS = {"day": timedelta(days=1), "hour": timedelta(hours=1)}
#: Partitions kept made ahead of now, by interval: a week of days, two days of hours.
AHEAD = {"day": 7, "hour": 48}
#: The partitioned tables and the time each is partitioned by.
KEYS = {"outbox_messages": "created_at", "inbox_messages": "received_at"}
SOURCES = {"outbox_messages": "outbox", "inbox_messages": "inbox"}

#: The time in a partition's name, by whether its interval is an hour.
_STAMPS = {False: "%Y%m%d", True: "%Y%m%d%H"}
_NAME = re.compile(r"^(outbox_messages|inbox_messages)_(legacy|p\d{8}|p\d{10})$")
_BOUND = re.compile(r"FROM \((MINVALUE|'[^']+')\) TO \((MAXVALUE|'[^']+')\)")
#: Why a partition past the retention is kept (`maintain`, `survey`).
KEPT_UNFINISHED = "holds unfinished or recently dead rows"
#: An instances row not seen for this long is a worker that died: `maintain` deletes it.
STALE_INSTANCE = timedelta(days=1)


def is_partition(name: str) -> bool:
    """True for the name of a partition this module makes (or the migration's legacy one)."""
    return _NAME.match(name) is not None


@dataclass(frozen=True)
class Partition:
    """One partition of a partitioned table: its range [lower, upper) in UTC."""

    parent: str
    name: str
    lower: datetime | None  # None: MINVALUE
    upper: datetime | None  # None: MAXVALUE
    detach_pending: bool = False


@dataclass
class MaintenanceResult:
    """What one `maintain` pass did."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    #: Partitions past the retention kept, with why (an unfinished row, a busy table).
    kept: dict[str, str] = field(default_factory=dict)
    #: Rows exported to the archive, by source ('outbox', 'inbox').
    exported: dict[str, int] = field(default_factory=dict)
    pruned_deliveries: int = 0
    #: Rows of the instances table not seen for STALE_INSTANCE (workers that died) deleted.
    pruned_instances: int = 0
    #: Payloads of the service's payload store past the retention removed (the claim check).
    pruned_payloads: int = 0
    #: Another pass held the lock: this one did nothing.
    busy: bool = False


#: Writes the rows of a detached partition to the archive: (conn, source, partition) -> rows.
Exporter = Callable[[Connection, str, Table], int]


def floor_time(moment: datetime, interval: str) -> datetime:
    """The start of the UTC day or hour `moment` falls in."""
    moment = moment.astimezone(UTC)
    if interval == "hour":
        return moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def partition_name(parent: str, start: datetime, interval: str) -> str:
    """``<parent>_pYYYYMMDD`` (a day) or ``<parent>_pYYYYMMDDHH`` (an hour)."""
    return f"{parent}_p{start.astimezone(UTC):{_STAMPS[interval == 'hour']}}"


@dataclass(frozen=True)
class Catalog:
    """The library's tables of a schema as one read of PostgreSQL's catalog finds them."""

    now: datetime  # the database's clock
    partitioned: list[str]  # of KEYS: both after migration 0006, none on an older revision
    partitions: dict[str, list[Partition]]  # by parent, oldest first
    detached: list[tuple[str, str]]  # (name, parent): partitions a pass detached, not dropped
    stats: dict[str, tuple[float, int]]  # by partition: estimated rows (-1: never), bytes


def catalog(conn: Connection, schema: str) -> Catalog:
    """`schema`'s `Catalog` in one statement. SchemaMissing when the tables do not exist."""
    rows = sql.schema_catalog(conn, schema)
    kinds = {r.name: r.kind for r in rows if r.name in KEYS}
    if len(kinds) < len(KEYS):
        raise SchemaMissing(
            f"the outbox/inbox tables do not exist in schema {schema!r}: "
            "run `outbox-inbox db upgrade`"
        )
    found: dict[str, list[Partition]] = {parent: [] for parent in KEYS}
    for row in (r for r in rows if r.parent in KEYS):
        if (match := _BOUND.search(row.bound)) is None:
            raise ValueError(f"{row.name}: not a range partition ({row.bound})")
        lower, upper = (_bound_time(v) for v in match.groups())
        found[row.parent].append(Partition(row.parent, row.name, lower, upper, bool(row.pending)))
    for parts in found.values():
        parts.sort(key=lambda p: p.lower or datetime.min.replace(tzinfo=UTC))
    detached = [
        (r.name, m.group(1)) for r in rows if r.parent is None and (m := _NAME.match(r.name))
    ]
    stats = {r.name: (r.rows, r.size) for r in rows if r.parent}
    return Catalog(rows[0].now, [n for n in KEYS if kinds[n] == "p"], found, detached, stats)


def partitions(conn: Connection, schema: str, parent: str) -> list[Partition]:
    """The partitions of `schema`.`parent`, oldest first."""
    return catalog(conn, schema).partitions[parent]


def _bound_time(value: str) -> datetime | None:
    if value in ("MINVALUE", "MAXVALUE"):
        return None
    return datetime.fromisoformat(value.strip("'")).astimezone(UTC)


def make_ahead(
    conn: Connection,
    tables: Tables,
    interval: str | None,
    now: datetime,
    cat: Catalog | None = None,
) -> list[str]:
    """Create the partitions from the newest one's end to ``AHEAD[interval]`` past `now`
    (`interval` None: the newest partition's length), each committed on its own. `cat`: the
    schema's catalog if just read."""
    made: list[str] = []
    cat = cat or catalog(conn, tables.schema)
    conn.commit()
    for parent, parts in cat.partitions.items():
        length = interval or _interval_of(parts)
        step = INTERVALS[length]
        until = floor_time(now, length) + step * AHEAD[length]
        start = max((p.upper for p in parts if p.upper), default=floor_time(now, length))
        while start < until:
            end = start + step
            name = partition_name(parent, start, length)
            sql.create_partition(conn, tables.schema, parent, name, start, end)
            conn.commit()
            made.append(name)
            start = end
    if made:
        log.info("partitions: made %s", ", ".join(made))
    return made


def _interval_of(existing: list[Partition]) -> str:
    newest = existing[-1] if existing else None
    if newest is None or newest.lower is None or newest.upper is None:
        return "day"
    return "hour" if newest.upper - newest.lower <= INTERVALS["hour"] else "day"


@dataclass(frozen=True)
class Retention:
    """How long partitions are kept: the retention of finished rows (None: for ever), and
    that of dead and parked rows (None: for ever)."""

    finished: timedelta | None
    dead: timedelta | None

    def cutoffs(self, now: datetime) -> tuple[datetime | None, datetime | None]:
        """The times before which finished and dead rows are past their retention."""
        finished, dead = (None if t is None else now - t for t in (self.finished, self.dead))
        return finished, dead


def maintain(
    engine: Engine,
    tables: Tables,
    *,
    interval: str | None,
    retention: Retention,
    exporter: Exporter | None = None,
) -> MaintenanceResult:
    """One maintenance pass (docs/history.md, "The maintenance pass"); PostgreSQL only, on
    connections of its own in autocommit mode. `interval`: of the partitions to make (None: as
    long as the newest one). Raises StorageError when the database fails; what was done stays."""
    result = MaintenanceResult()
    try:
        with held_lock(engine, lambda conn: sql.try_maintenance_lock(conn, tables.schema)) as held:
            if not held:
                return MaintenanceResult(busy=True)
            with engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                _maintain(conn, tables, interval, retention, exporter, result)
    except SQLAlchemyError as exc:
        raise storage_error(exc, "maintaining the partitions") from exc
    return result


@contextmanager
def held_lock(engine: Engine, take: Callable[[Connection], bool]) -> Iterator[bool]:
    """Whether `take` got its transaction-level advisory lock, on a connection of its own whose
    transaction stays open, holding the lock, until the block ends: through a connection pooler
    in transaction mode that transaction keeps one server session, and the lock ends with it,
    whatever becomes of the block. Ending it leaves no state on the connection."""
    with engine.connect() as conn:
        held = take(conn)
        try:
            yield held
        finally:
            try:
                conn.rollback()
            except SQLAlchemyError:  # closing the connection ends the transaction and its lock
                log.warning("could not end the transaction of a lock: closing its connection")
                conn.invalidate()


def _maintain(
    conn: Connection,
    tables: Tables,
    interval: str | None,
    retention: Retention,
    exporter: Exporter | None,
    result: MaintenanceResult,
) -> None:
    found = catalog(conn, tables.schema)
    if not found.partitioned:
        # Migration 0006 not applied yet: a service started before it (a rolling upgrade)
        # has nothing to maintain, and a partition made here could not be attached.
        return
    cutoff, dead_cutoff = retention.cutoffs(found.now)

    def retire(parent: str, name: str, was: Partition | None) -> None:
        """A detached partition: export and drop it, or attach it again if a row in it is
        unfinished (`was`: its range; None: read from the CHECK its detach left)."""
        rows = partition_rows(tables, parent, name)
        if holds_unfinished(conn, rows, parent, dead_cutoff):
            found = (was.lower, was.upper) if was else _detached_range(conn, tables.schema, name)
            sql.attach(conn, tables.schema, parent, name, *found)  # type: ignore[arg-type]
            result.kept[name] = "a row in it became unfinished: attached again"
            log.warning(
                "partitions: %s holds an unfinished row after its detach: attached again", name
            )
            return
        if exporter is not None:
            count = exporter(conn, SOURCES[parent], rows)
            result.exported[SOURCES[parent]] = result.exported.get(SOURCES[parent], 0) + count
        sql.drop_table(conn, tables.schema, name)
        result.dropped.append(name)
        log.info("partitions: dropped %s", name)

    for name, parent in found.detached:  # left by a pass that died
        retire(parent, name, None)
    # Finalised first, whatever its range: while one partition of a table is pending detach,
    # PostgreSQL refuses every other DETACH CONCURRENTLY on that table, so an older partition
    # reached first in the loop below would fail every pass from then on.
    for p in (p for parts in found.partitions.values() for p in parts if p.detach_pending):
        sql.detach(conn, tables.schema, p.parent, p.name, finalize=True)
        retire(p.parent, p.name, p)
    result.created = make_ahead(conn, tables, interval, found.now, found)
    # A worker that died keeps its row until another worker of its service advertises
    # (queries.roles.advertise_instance): a service that no longer runs would keep it for ever.
    result.pruned_instances = archive.prune_instances(conn, tables, found.now - STALE_INSTANCE)
    if cutoff is None:
        return
    for p in (p for parts in found.partitions.values() for p in parts if not p.detach_pending):
        if p.upper is None or p.upper > cutoff:
            continue
        if holds_unfinished(conn, partition_rows(tables, p.parent, p.name), p.parent, dead_cutoff):
            result.kept[p.name] = KEPT_UNFINISHED
            continue
        sql.detach(conn, tables.schema, p.parent, p.name, finalize=False)
        retire(p.parent, p.name, p)
    result.pruned_deliveries = archive.prune_deliveries(conn, tables, cutoff)


def _detached_range(
    conn: Connection, schema: str, name: str
) -> tuple[datetime | None, datetime | None]:
    """The range of a detached partition, from the CHECK constraint DETACH CONCURRENTLY adds
    (or, for the legacy partition, its bound)."""
    defs = sql.check_constraints(conn, schema, name)
    times = [_bound_time(t) for d in defs for t in re.findall(r"'(\d{4}-[^']+)'", d)]
    found = sorted(t for t in times if t is not None)
    if not found and not name.endswith("_legacy"):
        # A plain DETACH (by hand) leaves no CHECK: the range is the one its name starts, of
        # the length its name gives (partition_name).
        stamp = name.rsplit("_p", 1)[1]
        hourly = len(stamp) == 10
        start = datetime.strptime(stamp, _STAMPS[hourly]).replace(tzinfo=UTC)
        return start, start + INTERVALS["hour" if hourly else "day"]
    if not found:
        raise ValueError(f"{name}: no range found to attach it again")
    return (None if name.endswith("_legacy") else found[0]), found[-1]


@dataclass(frozen=True)
class PartitionState:
    """A partition as `survey` finds it: its estimated rows (None: never analysed), its size
    with indexes and TOAST, and, past the retention, whether a maintenance pass keeps it."""

    partition: Partition
    rows: int | None
    size_bytes: int
    past_retention: bool
    #: Why a partition past the retention stays (None: the next pass drops it, or not past).
    kept: str | None

    def as_dict(self) -> dict[str, Any]:
        p = self.partition
        return {
            "table": p.parent,
            "name": p.name,
            "from": p.lower.isoformat() if p.lower else None,
            "to": p.upper.isoformat() if p.upper else None,
            "detach_pending": p.detach_pending,
            "rows": self.rows,
            "size_bytes": self.size_bytes,
            "past_retention": self.past_retention,
            "kept": self.kept,
        }


def partitioned(conn: Connection, schema: str) -> list[str]:
    """The library's tables of `schema` that are partitioned (both, after migration 0006;
    none on an older revision). SchemaMissing when the tables do not exist."""
    return catalog(conn, schema).partitioned


def survey(conn: Connection, tables: Tables, retention: Retention) -> list[PartitionState]:
    """Every partition of the outbox and the inbox, each table's oldest first, with what
    `maintain` would do with those past `retention` (database clock): ``outbox-inbox
    partitions list``, read-only. Empty for plain tables. Raises StorageError when the
    database fails, SchemaMissing without tables."""
    try:
        found = catalog(conn, tables.schema)
        cutoff, dead_cutoff = retention.cutoffs(found.now)
        states: list[PartitionState] = []
        for parent in found.partitioned:
            for p in found.partitions[parent]:
                rows, size = found.stats.get(p.name, (-1, 0))
                past = cutoff is not None and p.upper is not None and p.upper <= cutoff
                held = past and holds_unfinished(
                    conn, partition_rows(tables, parent, p.name), parent, dead_cutoff
                )
                count = None if rows < 0 else int(rows)  # -1: never vacuumed or analysed
                kept = KEPT_UNFINISHED if held else None
                states.append(PartitionState(p, count, int(size), past, kept))
        return states
    except SQLAlchemyError as exc:
        raise storage_error(exc, "reading the partitions") from exc
