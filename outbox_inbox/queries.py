"""Every SQL statement the library runs, named, built with SQLAlchemy Core.

Each function takes the connection to run on as its first argument and never commits it: the
caller decides the transaction. Values always travel as bound parameters.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    exists,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.orm import Session

from .tables import DEAD, PENDING, PROCESSED, Tables, outbox_unsent

#: Advisory-lock namespaces (the first key of the two-key form). Writers of one ordering key
#: serialize on WRITER_LOCK; a relay holds RELAY_LOCK on each key it is publishing.
WRITER_LOCK = 0x0B0C
RELAY_LOCK = 0x0B0D

Executor = Session | Connection


def _is_postgres(executor: Executor) -> bool:
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    return bind.dialect.name == "postgresql"


# --- outbox -------------------------------------------------------------------------------


def insert_outbox(executor: Executor, tables: Tables, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert outbox rows in the caller's transaction.

    On PostgreSQL the writer first takes a transaction-scoped advisory lock on each ordering
    key, so two transactions writing the same key take their ids one after the other: id order
    is commit order for a key, which is the order the relay publishes it in.
    """
    keys = sorted({row["key"] for row in rows if row.get("key") is not None})
    if keys and _is_postgres(executor):
        for key in keys:  # sorted: two writers of several keys lock them in one order
            executor.execute(
                select(func.pg_advisory_xact_lock(WRITER_LOCK, func.hashtext(bindparam("k")))),
                {"k": key},
            )
    executor.execute(tables.outbox.insert(), list(rows))


def claim_outbox(conn: Connection, tables: Tables, limit: int) -> list[RowMapping]:
    """Lock up to `limit` publishable rows in id order (``FOR UPDATE SKIP LOCKED``).

    A keyed row qualifies only while no earlier row of its key waits for a retry, and only if
    this transaction gets the relay's advisory lock on the key: another relay holding the key
    may be publishing its earlier rows. Locks last until the transaction ends.
    """
    o = tables.outbox
    earlier = o.alias("earlier")
    held_back = exists().where(
        earlier.c.key == o.c.key,
        outbox_unsent(earlier),
        earlier.c.id < o.c.id,
        earlier.c.available_at > func.now(),
    )
    key_free = and_(~held_back, func.pg_try_advisory_xact_lock(RELAY_LOCK, func.hashtext(o.c.key)))
    stmt = (
        select(o, func.now().label("claimed_at"))
        .where(
            outbox_unsent(o),
            o.c.available_at <= func.now(),
            or_(o.c.key.is_(None), key_free),
        )
        .order_by(o.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=o)
    )
    return list(conn.execute(stmt).mappings())


def mark_published(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Set published_at on confirmed rows."""
    if ids:
        o = tables.outbox
        conn.execute(update(o).where(o.c.id.in_(ids)).values(published_at=func.now()))


def mark_expired(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Set expired_at on rows whose time to live ran out before they were published."""
    if ids:
        o = tables.outbox
        conn.execute(update(o).where(o.c.id.in_(ids)).values(expired_at=func.now()))


def mark_publish_failed(
    conn: Connection, tables: Tables, ids: Sequence[int], error: str, delay: timedelta
) -> None:
    """Count a failed attempt on rows that stay unpublished, and hold them back for `delay`."""
    if ids:
        o = tables.outbox
        conn.execute(
            update(o)
            .where(o.c.id.in_(ids))
            .values(
                attempts=o.c.attempts + 1,
                last_error=error[:2000],
                available_at=func.now() + delay,
            )
        )


def outbox_backlog(conn: Connection, tables: Tables) -> tuple[int, float | None]:
    """Unpublished rows and the age in seconds of the oldest one."""
    o = tables.outbox
    row = conn.execute(select(func.count(), func.min(o.c.created_at)).where(outbox_unsent(o))).one()
    count, oldest = row
    age = None
    if oldest is not None:
        age = conn.execute(select(func.extract("epoch", func.now() - literal(oldest)))).scalar_one()
    return int(count), float(age) if age is not None else None


# --- inbox --------------------------------------------------------------------------------


def insert_inbox(conn: Connection, tables: Tables, rows: Sequence[Mapping[str, Any]]) -> int:
    """Store received messages once each: a message_id already stored is skipped.

    Returns how many rows were new.
    """
    if not rows:
        return 0
    stmt = (
        pg_insert(tables.inbox)
        .values(list(rows))
        .on_conflict_do_nothing(index_elements=["message_id"])
        .returning(tables.inbox.c.id)
    )
    return len(conn.execute(stmt).all())


def claim_inbox(
    conn: Connection, tables: Tables, worker: str, limit: int, lease: timedelta
) -> list[RowMapping]:
    """Lease up to `limit` due pending rows to `worker`; count the claim in `attempts`.

    Highest priority first, then arrival order. A keyed row qualifies only when no earlier
    pending row has its key: a key is handled one message at a time, in order. The claim
    commits with the caller's transaction, so the count survives a crash of the handler.
    """
    i = tables.inbox
    earlier = i.alias("earlier")
    due = (
        select(i.c.id)
        .where(
            i.c.status == PENDING,
            i.c.next_attempt_at <= func.now(),
            or_(i.c.locked_until.is_(None), i.c.locked_until <= func.now()),
            or_(
                i.c.key.is_(None),
                ~exists().where(
                    earlier.c.key == i.c.key,
                    earlier.c.status == PENDING,
                    earlier.c.id < i.c.id,
                ),
            ),
        )
        .order_by(i.c.priority.desc(), i.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    stmt = (
        update(i)
        .where(i.c.id.in_(due))
        .values(locked_until=func.now() + lease, locked_by=worker, attempts=i.c.attempts + 1)
        .returning(*i.c, func.now().label("claimed_at"))
    )
    rows = list(conn.execute(stmt).mappings())
    rows.sort(key=lambda r: (-r["priority"], r["id"]))
    return rows


def lock_claimed(conn: Connection, tables: Tables, ids: Sequence[int], worker: str) -> set[int]:
    """Row-lock the claimed rows that are still leased to `worker` and pending.

    The row lock keeps any other worker away while the handlers run, even if the lease runs out.
    """
    i = tables.inbox
    stmt = (
        select(i.c.id)
        .where(i.c.id.in_(ids), i.c.locked_by == worker, i.c.status == PENDING)
        .with_for_update()
    )
    return set(conn.execute(stmt).scalars())


def mark_processed(conn: Connection, tables: Tables, ids: Sequence[int]) -> None:
    """Mark rows processed and release their lease."""
    if ids:
        i = tables.inbox
        conn.execute(
            update(i)
            .where(i.c.id.in_(ids))
            .values(
                status=PROCESSED,
                processed_at=func.now(),
                finished=i.c.finished + 1,
                locked_until=None,
                locked_by=None,
                last_error=None,
            )
        )


def mark_retry(conn: Connection, tables: Tables, row_id: int, error: str, delay: timedelta) -> None:
    """A handled failure: the row stays pending and is due again after `delay`."""
    i = tables.inbox
    conn.execute(
        update(i)
        .where(i.c.id == row_id)
        .values(
            finished=i.c.finished + 1,
            next_attempt_at=func.now() + delay,
            locked_until=None,
            locked_by=None,
            last_error=error,
        )
    )


def mark_dead(
    conn: Connection, tables: Tables, row_id: int, reason: str, error: str | None, *, finished: bool
) -> None:
    """A row that will never be handled: status dead, with the reason and the last error."""
    i = tables.inbox
    values: dict[str, Any] = {
        "status": DEAD,
        "dead_reason": reason[:255],
        "processed_at": func.now(),
        "locked_until": None,
        "locked_by": None,
    }
    if error is not None:
        values["last_error"] = error
    if finished:
        values["finished"] = i.c.finished + 1
    conn.execute(update(i).where(i.c.id == row_id).values(**values))


def release_claims(conn: Connection, tables: Tables, ids: Sequence[int], worker: str) -> None:
    """Give back claims this worker will not run (it is stopping); they do not count."""
    if ids:
        i = tables.inbox
        conn.execute(
            update(i)
            .where(i.c.id.in_(ids), i.c.locked_by == worker, i.c.status == PENDING)
            .values(locked_until=None, locked_by=None, attempts=i.c.attempts - 1)
        )


def inbox_counts(conn: Connection, tables: Tables) -> dict[str, int]:
    """Rows per status."""
    i = tables.inbox
    rows = conn.execute(select(i.c.status, func.count()).group_by(i.c.status)).all()
    return {status: int(n) for status, n in rows}


def count_deliveries(
    conn: Connection, tables: Tables, message_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, int]:
    """Add one delivery to each message id (upsert) and return the new counts."""
    if not message_ids:
        return {}
    d = tables.deliveries
    insert = pg_insert(d).values([{"message_id": m, "deliveries": 1} for m in message_ids])
    stmt = insert.on_conflict_do_update(
        index_elements=[d.c.message_id],
        set_={"deliveries": d.c.deliveries + 1, "last_seen_at": func.now()},
    ).returning(d.c.message_id, d.c.deliveries)
    return {m: int(n) for m, n in conn.execute(stmt).all()}


def database_now(conn: Connection) -> Any:
    """The database clock: leases and delays are judged by it, never by the host's."""
    return conn.execute(select(func.now())).scalar_one()


def set_idle_timeout(conn: Connection, seconds: float) -> None:
    """End this session if it idles inside a transaction for longer than `seconds`.

    A worker whose handler hangs keeps its row locks; the server ends its session after the
    lease, so the rows go back to the queue and the hung work can never commit.
    """
    conn.execute(
        select(
            func.set_config("idle_in_transaction_session_timeout", str(int(seconds * 1000)), False)
        )
    )
