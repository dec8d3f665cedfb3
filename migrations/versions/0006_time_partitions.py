"""Time-partitioned outbox and inbox on PostgreSQL, converted live.

``outbox_messages`` becomes a table partitioned by range of ``created_at``, ``inbox_messages``
by range of ``received_at``. The existing table is not copied: it becomes the first partition,
``<table>_legacy``, holding every time before a bound B (the start of the next UTC day, or of
the day after when that is less than two hours away), and daily partitions from B follow it
for a week. The library makes further partitions ahead and drops old ones itself
(outbox_inbox.partitions).

Writers are never refused and wait at most for a few catalogue changes:

1. outside any transaction, while writers run: a unique index on ``(id, <time>)`` is built
   CONCURRENTLY, and a CHECK ``<time> < B`` is added NOT VALID, then VALIDATEd (a scan that
   blocks no writer);
2. in one short transaction: the table and its indexes are renamed to ``…_legacy``, the
   partitioned table is created like it, with the primary key ``(id, <time>)`` and the same
   partial indexes, and the legacy table is attached (no scan: the CHECK proves the bound; its
   indexes match the new ones and are adopted, not rebuilt); ids continue after the legacy
   table's; the NOTIFY trigger moves to the new table; the week's partitions are made.

The inbox gains an index of its processed rows by processed_at (``status`` reads the newest
one, and their count, from it): built CONCURRENTLY on the existing table in step 1, adopted by
the attach in step 2; on SQLite simply created.

A message id stays unique in each partition (a unique index per partition); the receiver
keeps it unique across partitions (queries.roles.insert_inbox). SQLite keeps plain tables.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import context, op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: Each partitioned table and the column it is partitioned by.
_KEYS = {"outbox_messages": "created_at", "inbox_messages": "received_at"}

#: The partial indexes of each table at revision 0005: (name, columns, where, include).
_INDEXES = {
    "outbox_messages": [
        (
            "ix_outbox_messages_unpublished",
            "id",
            "published_at IS NULL AND expired_at IS NULL AND dead_at IS NULL",
            None,
        ),
        (
            "ix_outbox_messages_unpublished_key",
            "key, id",
            "published_at IS NULL AND expired_at IS NULL AND dead_at IS NULL AND key IS NOT NULL",
            None,
        ),
        ("ix_outbox_messages_dead", "id", "dead_at IS NOT NULL", None),
        (
            "ix_outbox_messages_dead_fingerprint",
            "fingerprint",
            "dead_at IS NOT NULL AND parked_at IS NULL",
            "routing_key, dead_at, replays",
        ),
    ],
    "inbox_messages": [
        ("ix_inbox_messages_pending", "priority DESC, id", "status = 'pending'", None),
        (
            "ix_inbox_messages_pending_key",
            "key, id",
            "status = 'pending' AND key IS NOT NULL",
            None,
        ),
        (
            "ix_inbox_messages_dead_fingerprint",
            "fingerprint",
            "status = 'dead'",
            "routing_key, processed_at, received_at, replays",
        ),
    ],
}

#: The partial indexes this revision adds: (name, column, where), built on the existing
#: table before the switch so that the attach adopts them instead of building them in it.
_ADDED = {
    "inbox_messages": [("ix_inbox_messages_processed", "processed_at", "status = 'processed'")],
    "outbox_messages": [],
}

_WEEK = 7


def _bound(now: datetime) -> datetime:
    """B: the start of the next UTC day, or of the day after if that is under 2 hours away."""
    day = (now + timedelta(hours=2)).astimezone(UTC)
    return datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(days=1)


def _literal(moment: datetime) -> str:
    # A time this migration computed, never input: the only value placed into its DDL.
    return f"'{moment.strftime('%Y-%m-%d %H:%M:%S')}+00'"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        for table, added in _ADDED.items():
            for name, column, where in added:
                op.create_index(name, table, [column], sqlite_where=sa.text(where))
        return
    schema = context.config.attributes["outbox_inbox_schema"]
    s = op.get_bind().dialect.identifier_preparer.quote_schema(schema)
    bound = _bound(op.get_bind().execute(sa.text("SELECT now()")).scalar_one())
    with op.get_context().autocommit_block():
        for table, key in _KEYS.items():
            _prepare_legacy(s, table, key, bound)
    for table, key in _KEYS.items():
        _switch(s, table, key, bound)


def _prepare_legacy(s: str, table: str, key: str, bound: datetime) -> None:
    """Step 1, outside a transaction: the unique index and the CHECK the attach needs."""
    conn = op.get_bind()
    exists = sa.text("SELECT to_regclass(:name) IS NOT NULL")
    index = f"{table}_legacy_id_time"
    if not conn.execute(exists, {"name": f"{s}.{index}"}).scalar_one():
        op.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {index} ON {s}.{table} (id, {key})")
    for name, column, where in _ADDED[table]:
        if not conn.execute(exists, {"name": f"{s}.{name}_legacy"}).scalar_one():
            op.execute(
                f"CREATE INDEX CONCURRENTLY {name}_legacy ON {s}.{table} ({column}) WHERE {where}"
            )
    op.execute(f"ALTER TABLE {s}.{table} DROP CONSTRAINT IF EXISTS {table}_legacy_bound")
    op.execute(
        f"ALTER TABLE {s}.{table} ADD CONSTRAINT {table}_legacy_bound "
        f"CHECK ({key} < {_literal(bound)}) NOT VALID"
    )
    op.execute(f"ALTER TABLE {s}.{table} VALIDATE CONSTRAINT {table}_legacy_bound")


def _switch(s: str, table: str, key: str, bound: datetime) -> None:
    """Step 2, in one transaction: the partitioned table, with the old one as a partition."""
    legacy = f"{table}_legacy"
    op.execute(f"DROP TRIGGER {table}_notify ON {s}.{table}")
    op.execute(f"ALTER TABLE {s}.{table} RENAME TO {legacy}")
    op.execute(f"ALTER TABLE {s}.{legacy} RENAME CONSTRAINT pk_{table} TO pk_{legacy}")
    op.execute(
        f"ALTER TABLE {s}.{legacy} RENAME CONSTRAINT uq_{table}_message_id "
        f"TO uq_{legacy}_message_id"
    )
    for name, *_ in _INDEXES[table]:
        op.execute(f"ALTER INDEX {s}.{name} RENAME TO {name}_legacy")
    op.execute(
        f"CREATE TABLE {s}.{table} (LIKE {s}.{legacy} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
        f"INCLUDING IDENTITY) PARTITION BY RANGE ({key})"
    )
    op.execute(f"ALTER TABLE {s}.{table} DROP CONSTRAINT {table}_legacy_bound")
    op.execute(f"ALTER TABLE {s}.{table} ADD CONSTRAINT pk_{table} PRIMARY KEY (id, {key})")
    for name, columns, where, include in _INDEXES[table]:
        covering = f" INCLUDE ({include})" if include else ""
        op.execute(f"CREATE INDEX {name} ON {s}.{table} ({columns}){covering} WHERE {where}")
    for name, column, where in _ADDED[table]:
        op.execute(f"CREATE INDEX {name} ON {s}.{table} ({column}) WHERE {where}")
    op.execute(
        f"ALTER TABLE {s}.{legacy} ADD CONSTRAINT {legacy}_id_time "
        f"UNIQUE USING INDEX {legacy}_id_time"
    )
    op.execute(
        f"ALTER TABLE {s}.{table} ATTACH PARTITION {s}.{legacy} "
        f"FOR VALUES FROM (MINVALUE) TO ({_literal(bound)})"
    )
    # The old key on id alone is now one more index to write for nothing: (id, <time>) is
    # the partition's key.
    op.execute(f"ALTER TABLE {s}.{legacy} DROP CONSTRAINT pk_{legacy}")
    # is_called false: the next id is the legacy sequence's next one, none skipped.
    op.execute(
        sa.text(
            "SELECT setval(pg_get_serial_sequence(:table, 'id'), "
            "nextval(pg_get_serial_sequence(:legacy, 'id')), false)"
        ).bindparams(table=f"{s}.{table}", legacy=f"{s}.{legacy}")
    )
    for day in range(_WEEK):
        start = bound + timedelta(days=day)
        name = f"{table}_p{start:%Y%m%d}"
        op.execute(
            f"CREATE TABLE {s}.{name} PARTITION OF {s}.{table} "
            f"FOR VALUES FROM ({_literal(start)}) TO ({_literal(start + timedelta(days=1))})"
        )
        op.execute(f"CREATE UNIQUE INDEX {name}_message_id ON {s}.{name} (message_id)")
    op.execute(
        f"CREATE TRIGGER {table}_notify AFTER INSERT ON {s}.{table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_inbox_notify()"
    )


def downgrade() -> None:
    """Plain tables again: every row copied into a new table (offline: writers wait)."""
    if op.get_bind().dialect.name != "postgresql":
        for table, added in _ADDED.items():
            for name, *_ in added:
                op.drop_index(name, table_name=table)
        return
    schema = context.config.attributes["outbox_inbox_schema"]
    s = op.get_bind().dialect.identifier_preparer.quote_schema(schema)
    for table in _KEYS:
        plain = f"{table}_plain"
        op.execute(
            f"CREATE TABLE {s}.{plain} (LIKE {s}.{table} INCLUDING DEFAULTS "
            "INCLUDING CONSTRAINTS INCLUDING IDENTITY)"
        )
        # The library's own quoted names, no input: the only things placed into this copy.
        op.execute(f"INSERT INTO {s}.{plain} SELECT * FROM {s}.{table}")  # noqa: S608
        newest: Any = op.get_bind().execute(
            sa.select(sa.func.max(sa.column("id"))).select_from(sa.table(plain, schema=schema))
        )
        op.execute(
            f"ALTER TABLE {s}.{plain} ALTER COLUMN id RESTART WITH {int(newest.scalar() or 0) + 1}"
        )
        op.execute(f"DROP TABLE {s}.{table} CASCADE")
        op.execute(f"ALTER TABLE {s}.{plain} RENAME TO {table}")
        op.execute(f"ALTER TABLE {s}.{table} ADD CONSTRAINT pk_{table} PRIMARY KEY (id)")
        op.execute(
            f"ALTER TABLE {s}.{table} ADD CONSTRAINT uq_{table}_message_id UNIQUE (message_id)"
        )
        for name, columns, where, include in _INDEXES[table]:
            covering = f" INCLUDE ({include})" if include else ""
            op.execute(f"CREATE INDEX {name} ON {s}.{table} ({columns}){covering} WHERE {where}")
        op.execute(
            f"CREATE TRIGGER {table}_notify AFTER INSERT ON {s}.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_inbox_notify()"
        )
