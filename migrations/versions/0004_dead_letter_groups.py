"""Dead-letter groups: a fingerprint of each dead row's cause, and its replays.

Adds ``fingerprint``, ``replays`` and ``replayed_at`` to the outbox and the inbox, a
``parked`` inbox status and an outbox ``parked_at`` (dead rows an operator set aside), and a
partial index of the dead rows by fingerprint on each table, covering what `groups()` reads.
Rows dead before this migration get their dead reason as fingerprint (what the library
fingerprints a death without an exception by).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from alembic import context, op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_time = sa.DateTime(timezone=True)
_STATUSES = "status IN ('pending', 'processed', 'dead')"
_STATUSES_PARKED = "status IN ('pending', 'processed', 'dead', 'parked')"
_OUTBOX_DEAD = "dead_at IS NOT NULL AND parked_at IS NULL"


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def _columns() -> list[sa.Column[Any]]:
    return [
        sa.Column("fingerprint", sa.String(255), nullable=True),
        sa.Column("replays", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("replayed_at", _time, nullable=True),
    ]


#: The partial indexes a SQLite table rebuild would lose the conditions of: (columns, where).
_PARTIAL: dict[str, dict[str, tuple[list[Any], str]]] = {
    "inbox_messages": {
        "ix_inbox_messages_pending": ([sa.text("priority DESC"), "id"], "status = 'pending'"),
        "ix_inbox_messages_pending_key": (
            ["key", "id"],
            "status = 'pending' AND key IS NOT NULL",
        ),
    },
    "outbox_messages": {
        "ix_outbox_messages_unpublished": (
            ["id"],
            "published_at IS NULL AND expired_at IS NULL AND dead_at IS NULL",
        ),
        "ix_outbox_messages_unpublished_key": (
            ["key", "id"],
            "published_at IS NULL AND expired_at IS NULL AND dead_at IS NULL AND key IS NOT NULL",
        ),
        "ix_outbox_messages_dead": (["id"], "dead_at IS NOT NULL"),
    },
}


@contextlib.contextmanager
def _altered(table: str, schema: str | None) -> Iterator[Any]:
    """A batch alteration of `table`. SQLite rebuilds the table: its partial indexes go first
    and are made again afterwards, so that their conditions are not lost in the copy."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        for name in _PARTIAL[table]:
            op.drop_index(name, table_name=table)
    with op.batch_alter_table(table, schema=schema) as batch:
        yield batch
    if sqlite:
        for name, (columns, where) in _PARTIAL[table].items():
            op.create_index(name, table, columns, sqlite_where=sa.text(where))


def upgrade() -> None:
    schema = _schema()
    for table in ("outbox_messages", "inbox_messages"):
        for column in _columns():
            op.add_column(table, column, schema=schema)
    op.add_column("outbox_messages", sa.Column("parked_at", _time, nullable=True), schema=schema)
    for table, dead in (("inbox_messages", "status = 'dead'"), ("outbox_messages", _OUTBOX_DEAD)):
        rows = sa.table(table, sa.column("fingerprint"), sa.column("dead_reason"), schema=schema)
        op.execute(
            rows.update()
            .where(sa.text(dead), rows.c.dead_reason.is_not(None))
            .values(fingerprint=rows.c.dead_reason)
        )
    with _altered("inbox_messages", schema) as batch:
        batch.drop_constraint("ck_inbox_messages_status", type_="check")
        batch.create_check_constraint("ck_inbox_messages_status", sa.text(_STATUSES_PARKED))
    op.create_index(
        "ix_inbox_messages_dead_fingerprint",
        "inbox_messages",
        ["fingerprint"],
        schema=schema,
        postgresql_include=["routing_key", "processed_at", "received_at", "replays"],
        postgresql_where=sa.text("status = 'dead'"),
        sqlite_where=sa.text("status = 'dead'"),
    )
    op.create_index(
        "ix_outbox_messages_dead_fingerprint",
        "outbox_messages",
        ["fingerprint"],
        schema=schema,
        postgresql_include=["routing_key", "dead_at", "replays"],
        postgresql_where=sa.text(_OUTBOX_DEAD),
        sqlite_where=sa.text(_OUTBOX_DEAD),
    )


def downgrade() -> None:
    schema = _schema()
    # Without the status a parked row would break the CHECK: it goes back among the dead.
    inbox = sa.table("inbox_messages", sa.column("status"), schema=schema)
    op.execute(inbox.update().where(inbox.c.status == "parked").values(status="dead"))
    op.drop_index("ix_inbox_messages_dead_fingerprint", table_name="inbox_messages", schema=schema)
    op.drop_index(
        "ix_outbox_messages_dead_fingerprint", table_name="outbox_messages", schema=schema
    )
    with _altered("inbox_messages", schema) as batch:
        batch.drop_constraint("ck_inbox_messages_status", type_="check")
        batch.create_check_constraint("ck_inbox_messages_status", sa.text(_STATUSES))
        for column in reversed(_columns()):
            batch.drop_column(column.name)
    with _altered("outbox_messages", schema) as batch:
        batch.drop_column("parked_at")
        for column in reversed(_columns()):
            batch.drop_column(column.name)
