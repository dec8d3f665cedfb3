"""The statements of the message history: what the archive reads, moves and deletes (and its
journal and lock), what the audit reads live, and the prunes of the partition maintenance."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, and_, delete, exists, func, insert, or_, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.sql.elements import ColumnElement

from ..clock import db_age
from ..tables import DEAD, PROCESSED, Tables
from .operations import dead_since, forget_deliveries


def _archivable(tables: Tables, source: str, cutoff: datetime) -> ColumnElement[bool]:
    """Rows finished before `cutoff`: published or expired outbox rows, processed or dead inbox
    rows. Pending and unpublished rows never qualify."""
    if source == "outbox":
        o = tables.outbox
        return or_(
            and_(o.c.published_at.is_not(None), o.c.published_at < cutoff),
            and_(o.c.expired_at.is_not(None), o.c.expired_at < cutoff),
        )
    i = tables.inbox
    return and_(i.c.status.in_([PROCESSED, DEAD]), dead_since(i) < cutoff)


def _archive_table(tables: Tables, source: str) -> Table:
    return tables.outbox if source == "outbox" else tables.inbox


def count_archivable(conn: Connection, tables: Tables, source: str, cutoff: datetime) -> int:
    """How many rows of `source` ('outbox' or 'inbox') finished before `cutoff`."""
    t = _archive_table(tables, source)
    stmt = select(func.count()).select_from(t).where(_archivable(tables, source, cutoff))
    return int(conn.execute(stmt).scalar_one())


def history_rows(
    conn: Connection,
    tables: Tables,
    source: str,
    *,
    cutoff: datetime | None = None,
    limit: int | None = None,
    of: Any = None,
    after_id: int | None = None,
) -> list[RowMapping]:
    """Rows of `source` ('outbox' or 'inbox'), lowest id first: with a `cutoff`, only those finished
    before it (what the archive moves), else every row (what the audit reads live). `of`: read this
    table instead (a detached partition, with the same columns); `after_id`: only rows with a
    greater id (keyset paging). Inbox rows carry their ``deliveries`` and ``duplicates`` counters
    from inbox_deliveries."""
    t = _archive_table(tables, source) if of is None else of
    if source == "outbox":
        stmt = select(t)
    else:
        d = tables.deliveries
        stmt = select(
            t,
            func.coalesce(d.c.deliveries, 0).label("deliveries"),
            func.coalesce(d.c.duplicates, 0).label("duplicates"),
        ).select_from(t.outerjoin(d, d.c.message_id == t.c.message_id))
    if cutoff is not None:
        stmt = stmt.where(_archivable(tables, source, cutoff))
    if after_id is not None:
        stmt = stmt.where(t.c.id > after_id)
    return list(conn.execute(stmt.order_by(t.c.id).limit(limit)).mappings())


def delete_archived(
    conn: Connection, tables: Tables, source: str, cutoff: datetime, ids: Sequence[int]
) -> int:
    """Delete the archived rows `ids` of `source` that still qualify; return how many. A row changed
    since it was written (a dead row replayed) no longer qualifies and stays. The inbox rows'
    delivery counters go with them."""
    if not ids:
        return 0
    t = _archive_table(tables, source)
    deleted = conn.execute(
        delete(t)
        .where(t.c.id.in_(list(ids)), _archivable(tables, source, cutoff))
        .returning(t.c.message_id)
    ).all()
    if source == "inbox" and deleted:
        forget_deliveries(conn, tables, [m for (m,) in deleted])
    return len(deleted)


def journal_archive_files(
    conn: Connection, tables: Tables, files: Sequence[tuple[uuid.UUID, str, str]]
) -> None:
    """Record (id, source, path) of Parquet files about to be written."""
    if files:
        rows = [{"id": f, "source_table": src, "path": path} for f, src, path in files]
        conn.execute(insert(tables.archive_files), rows)


def unfinished_archive_files(conn: Connection, tables: Tables) -> list[RowMapping]:
    """Journaled files whose batch did not finish: (id, source_table, path), oldest first."""
    a = tables.archive_files
    return list(conn.execute(select(a).order_by(a.c.created_at, a.c.id)).mappings())


def forget_archive_files(conn: Connection, tables: Tables, ids: Sequence[uuid.UUID]) -> None:
    """Drop journal rows: their batch finished or wrote nothing."""
    if ids:
        a = tables.archive_files
        conn.execute(delete(a).where(a.c.id.in_(list(ids))))


def try_archive_lock(conn: Connection, schema: str) -> bool:
    """Take the lock that lets one archive run per schema (`try_xact_lock`: the caller keeps
    the transaction open for the whole run); False when it is held. SQLite has no such lock:
    one process writes it at a time anyway, and its archive is run by hand."""
    return conn.dialect.name != "postgresql" or try_xact_lock(
        conn, f"outbox_inbox.archive.{schema}"
    )


def try_xact_lock(conn: Connection, key: str) -> bool:
    """Take the transaction-level advisory lock of `key` if it is free, held until `conn`'s
    transaction ends (so a pooler can never hand it to another client), which no idle timeout
    ends early: the transaction sets ``idle_in_transaction_session_timeout`` to 0 for itself."""
    conn.execute(select(func.set_config("idle_in_transaction_session_timeout", "0", True)))
    held = bool(conn.execute(select(func.pg_try_advisory_xact_lock(func.hashtext(key)))).scalar())
    # A statement with parameters leaves its portal open, and with it a snapshot, until the
    # next statement; one without goes by the simple protocol and closes it. Kept, that
    # snapshot would make a DETACH … FINALIZE, which waits for every older snapshot, wait for
    # ever (and hold back vacuum while the lock is held).
    conn.exec_driver_sql("SELECT 1")
    return held


def prune_deliveries(conn: Connection, tables: Tables, cutoff: datetime) -> int:
    """Delete delivery counters last seen before `cutoff` whose message has no inbox row. They
    belong to messages the receiver dead-lettered or already archived."""
    d, i = tables.deliveries, tables.inbox
    stmt = delete(d).where(
        d.c.last_seen_at < cutoff, ~exists().where(i.c.message_id == d.c.message_id)
    )
    return int(conn.execute(stmt).rowcount or 0)


def prune_payloads(conn: Connection, tables: Tables, seconds: float) -> int:
    """Delete the payloads stored more than `seconds` ago (database clock); how many."""
    p = tables.payloads
    return int(conn.execute(delete(p).where(db_age(p.c.created_at) > seconds)).rowcount or 0)


def prune_instances(conn: Connection, tables: Tables, cutoff: datetime) -> int:
    """Delete the rows of every service's instances last seen before `cutoff`: workers that
    died, of services no worker of which runs any more to forget them. Returns how many."""
    n = tables.instances
    return int(conn.execute(delete(n).where(n.c.seen_at < cutoff)).rowcount or 0)
