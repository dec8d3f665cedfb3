"""Move finished messages from the hot tables into Parquet files: the message history. The layout of
the files and the steps that make a batch crash-safe are in docs/history.md ("Archive layout",
"Crash safety"). One run at a time per schema (a transaction-level advisory lock, held by a
transaction that stays open for the run)."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from .errors import ConfigurationError, OutboxInboxError, storage_error
from .partitions import Retention, held_lock, maintain
from .queries import archive, operations
from .tables import Tables

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

OUTBOX, INBOX, SUBSCRIPTIONS = "outbox", "inbox", "subscriptions"
SOURCES = (OUTBOX, INBOX)

#: The columns the outbox and the inbox rows share, between their routing and their times.
_MESSAGE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("payload", "string"),  # JSON text
    ("headers", "string"),  # JSON text
    ("version", "int32"),
    ("correlation_id", "string"),
    ("causation_id", "string"),
    ("key", "string"),
    ("priority", "int32"),
    ("created_at", "timestamp"),
)

#: Columns of the archived outbox rows, in file order, with their Arrow type names.
OUTBOX_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "int64"),
    ("message_id", "string"),
    ("kind", "string"),
    ("exchange", "string"),
    ("routing_key", "string"),
    *_MESSAGE_COLUMNS,
    ("available_at", "timestamp"),
    ("expires_at", "timestamp"),
    ("published_at", "timestamp"),
    ("expired_at", "timestamp"),
    ("attempts", "int32"),  # failed publish attempts
    ("last_error", "string"),
    ("archived_at", "timestamp"),
)

#: Columns of the archived inbox rows, in file order, with their Arrow type names.
INBOX_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "int64"),
    ("message_id", "string"),
    ("source", "string"),
    ("kind", "string"),
    ("routing_key", "string"),
    *_MESSAGE_COLUMNS,
    ("expires_at", "timestamp"),
    ("received_at", "timestamp"),
    ("status", "string"),
    ("attempts", "int32"),  # claims by workers
    ("finished", "int32"),
    ("processed_at", "timestamp"),
    ("last_error", "string"),
    ("dead_reason", "string"),
    ("deliveries", "int32"),  # broker redeliveries counted by the receiver
    ("duplicates", "int32"),  # deliveries dropped as already stored
    ("archived_at", "timestamp"),
)

SUBSCRIPTION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("exchange", "string"),
    ("pattern", "string"),
    ("subscribed_at", "timestamp"),
)

#: The date partition of each source's rows: the day of the first of its columns that is set.
#: An outbox row is dated by its publication (or expiry), which follows its commit: a row that
#: commits late is dated late, in the day it became visible (docs/history.md, "Archive layout").
DATE_COLUMNS = {OUTBOX: ("published_at", "expired_at", "created_at"), INBOX: ("received_at",)}
COLUMNS = {OUTBOX: OUTBOX_COLUMNS, INBOX: INBOX_COLUMNS, SUBSCRIPTIONS: SUBSCRIPTION_COLUMNS}


class ArchiveError(OutboxInboxError):
    """The archive could not be written."""


class ArchiveBusy(ArchiveError):
    """Another archive run holds this schema's archive lock."""


def require_pyarrow() -> Any:
    """Import pyarrow, or raise ConfigurationError naming the extra that installs it."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ConfigurationError(
            "the archive needs pyarrow: pip install 'outbox-inbox[archive]'"
        ) from exc
    return pyarrow


def arrow_schema(source: str) -> pa.Schema:
    """The Arrow schema of `source` ('outbox', 'inbox' or 'subscriptions') files."""
    pa = require_pyarrow()
    types = {
        "int64": pa.int64(),
        "int32": pa.int32(),
        "string": pa.string(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    return pa.schema([pa.field(name, types[kind]) for name, kind in COLUMNS[source]])


@dataclass
class ArchiveResult:
    """What one run did."""

    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    files: int = 0
    recovered_files: int = 0  # unfinished files of a crashed run, completed
    abandoned_files: int = 0  # journaled files that were never written
    kept_rows: int = 0  # written but changed since (a replayed dead row): left in the table
    pruned_deliveries: int = 0
    cutoff: datetime | None = None
    interrupted: bool = False
    partitions: list[str] = field(default_factory=list)  # exported, then dropped whole


class Archiver:
    """Archive one service's finished rows older than `older_than` into `root` (a local or
    mounted directory), on connections of its own, committing its own transactions. `progress`
    is called with the source and the number of rows after each batch."""

    def __init__(
        self,
        engine: Engine,
        tables: Tables,
        service: str,
        root: str | os.PathLike[str],
        *,
        older_than: timedelta,
        batch_size: int = 10_000,
        progress: Callable[[str, int], None] | None = None,
    ) -> None:
        if older_than < timedelta(0):
            raise ConfigurationError("older_than must not be negative")
        if batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        require_pyarrow()
        self._engine, self._tables, self.service = engine, tables, service
        self.root = Path(root).absolute()
        self.older_than, self.batch_size, self._progress = older_than, batch_size, progress

    def count(self) -> dict[str, int]:
        """How many rows of each source the next run would archive (a point-in-time count)."""
        with self._engine.connect() as conn:
            cutoff = self._cutoff(conn)
            return {s: archive.count_archivable(conn, self._tables, s, cutoff) for s in SOURCES}

    def run(self, stop: threading.Event | None = None) -> ArchiveResult:
        """Finish a crashed run's files, archive every qualifying row, prune stale counters. Returns
        after the last batch, or after the batch in hand once `stop` is set. Raises ArchiveBusy when
        another run holds the lock, StorageError when the database fails and ArchiveError when a
        file cannot be written; what was done until then stays done."""
        stop = stop or threading.Event()
        result = ArchiveResult()
        schema = self._tables.schema
        try:
            with held_lock(
                self._engine, lambda conn: archive.try_archive_lock(conn, schema)
            ) as held:
                if not held:
                    raise ArchiveBusy(f"another archive run holds the lock of schema {schema!r}")
                self._archive(stop, result)
        except SQLAlchemyError as exc:
            raise storage_error(exc, "archiving") from exc
        return result

    def _archive(self, stop: threading.Event, result: ArchiveResult) -> None:
        self._recover(result)
        with self._engine.connect() as conn:
            cutoff = result.cutoff = self._cutoff(conn)
        self._write_subscriptions()
        if self._engine.dialect.name == "postgresql":
            self._retire_partitions(result)
        for source in SOURCES:
            while not stop.is_set():
                if self._batch(source, cutoff, result) < self.batch_size:
                    break
        result.interrupted = stop.is_set()
        if not result.interrupted:
            with self._engine.begin() as conn:
                result.pruned_deliveries = archive.prune_deliveries(conn, self._tables, cutoff)

    def _retire_partitions(self, result: ArchiveResult) -> None:
        """Export and drop the partitions wholly past `older_than` (dead rows included):
        what the rows path below would move row by row, moved a partition at a time."""
        done = maintain(
            self._engine,
            self._tables,
            interval=None,
            retention=Retention(self.older_than, self.older_than),
            exporter=partition_exporter(self._tables, self.service, self.root),
        )
        for source, rows in done.exported.items():
            result.rows[source] += rows
        result.partitions = done.dropped

    def _cutoff(self, conn: Any) -> datetime:
        now = _utc(operations.database_now(conn))
        assert now is not None
        return now - self.older_than

    def _batch(self, source: str, cutoff: datetime, result: ArchiveResult) -> int:
        """Archive one batch of `source`; return how many rows were read."""
        with self._engine.begin() as conn:
            rows = archive.history_rows(
                conn, self._tables, source, cutoff=cutoff, limit=self.batch_size
            )
            archived_at = _utc(operations.database_now(conn))
        if not rows:
            return 0
        files = [
            (uuid.uuid4(), day, day_rows) for day, day_rows in _by_day(source, rows, archived_at)
        ]
        paths = {file_id: self._path(source, day, file_id) for file_id, day, _ in files}
        with self._engine.begin() as conn:
            archive.journal_archive_files(
                conn, self._tables, [(f, source, str(paths[f])) for f, _, _ in files]
            )
        for file_id, _, day_rows in files:
            write_parquet(paths[file_id], source, to_records(source, day_rows, archived_at))
        ids = [int(row["id"]) for row in rows]
        with self._engine.begin() as conn:
            deleted = archive.delete_archived(conn, self._tables, source, cutoff, ids)
            archive.forget_archive_files(conn, self._tables, [f for f, _, _ in files])
        result.rows[source] += deleted
        result.kept_rows += len(ids) - deleted
        result.files += len(files)
        log.info(
            "archive: %d %s rows of %s into %d file(s)",
            deleted,
            source,
            self.service,
            len(files),
            extra={"service": self.service, "source": source, "rows": deleted},
        )
        if self._progress is not None:
            self._progress(source, len(rows))
        return len(rows)

    def _recover(self, result: ArchiveResult) -> None:
        """Finish the journaled files of a run that did not end."""
        with self._engine.connect() as conn:
            unfinished = archive.unfinished_archive_files(conn, self._tables)
        for entry in unfinished:
            path = Path(entry["path"])
            source = entry["source_table"]
            written = path.exists()
            ids = read_ids(path) if written else []
            if not written:
                _temporary(path).unlink(missing_ok=True)
            # The cutoff of that run is unknown; "finished at all" still guards replays.
            with self._engine.begin() as conn:
                deleted = archive.delete_archived(
                    conn, self._tables, source, datetime.max.replace(tzinfo=UTC), ids
                )
                archive.forget_archive_files(conn, self._tables, [entry["id"]])
            if written:
                result.recovered_files += 1
                result.rows[source] += deleted
                result.kept_rows += len(ids) - deleted
                log.warning(
                    "archive: completed %s left by an interrupted run (%d rows deleted)",
                    path,
                    deleted,
                )
            else:
                result.abandoned_files += 1
                log.warning("archive: %s of an interrupted run was never written", path)

    def _write_subscriptions(self) -> None:
        with self._engine.connect() as conn:
            rows = operations.subscriptions_of(conn, self._tables)
        path = self.root / SUBSCRIPTIONS / f"service={self.service}" / "subscriptions.parquet"
        mine = [r for r in rows if r["service"] == self.service]
        write_parquet(path, SUBSCRIPTIONS, to_records(SUBSCRIPTIONS, mine, None))

    def _path(self, source: str, day: date, file_id: uuid.UUID) -> Path:
        partition = self.root / source / f"service={self.service}" / f"date={day.isoformat()}"
        return partition / f"part-{file_id}.parquet"


def partition_exporter(
    tables: Tables, service: str, root: str | os.PathLike[str], *, chunk: int = 50_000
) -> Callable[[Any, str, Any], int]:
    """What `partitions.maintain` calls to export a detached partition before it drops it:
    its rows, `chunk` at a time, into ``part-<partition>-<n>.parquet`` files whose names depend
    only on the partition, so a pass that dies part-way writes the same files again."""
    require_pyarrow()
    base = Path(root).absolute()

    def export(conn: Any, source: str, rows: Any) -> int:
        archived_at = _utc(operations.database_now(conn))
        count, after, n = 0, None, 0
        while True:
            batch = archive.history_rows(conn, tables, source, limit=chunk, of=rows, after_id=after)
            if not batch:
                return count
            for day, day_rows in _by_day(source, batch, archived_at):
                folder = base / source / f"service={service}" / f"date={day.isoformat()}"
                path = folder / f"part-{rows.name}-{n:05d}.parquet"
                write_parquet(path, source, to_records(source, day_rows, archived_at))
                n += 1
            count += len(batch)
            after = int(batch[-1]["id"])

    return export


def _by_day(source: str, rows: list[Any], archived_at: Any) -> list[tuple[date, list[Any]]]:
    """`rows` by the UTC day of their date columns (`DATE_COLUMNS`), earliest first."""
    by_day: dict[date, list[Any]] = {}
    for row in rows:
        at = next((row[c] for c in DATE_COLUMNS[source] if row[c] is not None), None)
        by_day.setdefault((_utc(at) or archived_at).date(), []).append(row)
    return sorted(by_day.items())


def write_parquet(path: Path, source: str, records: Sequence[Mapping[str, Any]]) -> None:
    """Write `records` to `path` durably: temporary name, fsync, atomic rename, fsync the
    directory. An existing file at `path` is replaced. Raises ArchiveError."""
    pa = require_pyarrow()
    table = pa.Table.from_pylist(list(records), schema=arrow_schema(source))
    tmp = _temporary(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pa.parquet.write_table(table, tmp, compression="zstd")
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArchiveError(f"could not write {path}: {exc}") from exc


def read_ids(path: Path) -> list[int]:
    """The row ids held by an archive file."""
    ids = require_pyarrow().parquet.read_table(path, columns=["id"]).column("id")
    return [int(v) for v in ids.to_pylist()]


def _temporary(path: Path) -> Path:
    # A leading dot hides the file from Spark and Hive readers while it is incomplete.
    return path.with_name(f".{path.name}.tmp")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_records(
    source: str, rows: Iterable[Any], archived_at: datetime | None
) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        record: dict[str, Any] = {}
        for name, kind in COLUMNS[source]:
            value = archived_at if name == "archived_at" else row.get(name)
            if name in ("payload", "headers"):
                value = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
            elif name == "message_id":
                value = str(value)
            elif kind == "timestamp":
                value = _utc(value)
            record[name] = value
        out.append(record)
    return out


def subscription_record(row: Any) -> dict[str, Any]:
    """A subscriptions row as archived: exchange, pattern, subscribed_at in UTC."""
    return to_records(SUBSCRIPTIONS, [row], None)[0]


def _utc(value: Any) -> datetime | None:
    """A timezone-aware UTC datetime; SQLite returns naive ones, which are UTC."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise TypeError(f"expected a datetime, got {value!r}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


__all__ = ["ArchiveBusy", "ArchiveError", "ArchiveResult", "Archiver", "arrow_schema"]
