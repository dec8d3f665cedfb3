"""Dead outbox rows: a row the broker refused on every attempt leaves the relay's way.

Adds ``dead_at`` and ``dead_reason`` to the outbox and leaves dead rows out of the partial
indexes of unsent rows, as published and expired ones are; dead rows get a partial index of
their own, for `status` and `dead-letters`.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_time = sa.DateTime(timezone=True)

_UNSENT_BEFORE = "published_at IS NULL AND expired_at IS NULL"
_UNSENT = "published_at IS NULL AND expired_at IS NULL AND dead_at IS NULL"


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def _drop_unsent_indexes(schema: str | None) -> None:
    op.drop_index("ix_outbox_messages_unpublished_key", table_name="outbox_messages", schema=schema)
    op.drop_index("ix_outbox_messages_unpublished", table_name="outbox_messages", schema=schema)


def _create_unsent_indexes(schema: str | None, unsent: str) -> None:
    op.create_index(
        "ix_outbox_messages_unpublished",
        "outbox_messages",
        ["id"],
        schema=schema,
        postgresql_where=sa.text(unsent),
        sqlite_where=sa.text(unsent),
    )
    keyed = f"{unsent} AND key IS NOT NULL"
    op.create_index(
        "ix_outbox_messages_unpublished_key",
        "outbox_messages",
        ["key", "id"],
        schema=schema,
        postgresql_where=sa.text(keyed),
        sqlite_where=sa.text(keyed),
    )


def upgrade() -> None:
    schema = _schema()
    op.add_column("outbox_messages", sa.Column("dead_at", _time, nullable=True), schema=schema)
    op.add_column(
        "outbox_messages", sa.Column("dead_reason", sa.String(255), nullable=True), schema=schema
    )
    _drop_unsent_indexes(schema)
    _create_unsent_indexes(schema, _UNSENT)
    op.create_index(
        "ix_outbox_messages_dead",
        "outbox_messages",
        ["id"],
        schema=schema,
        postgresql_where=sa.text("dead_at IS NOT NULL"),
        sqlite_where=sa.text("dead_at IS NOT NULL"),
    )


def downgrade() -> None:
    schema = _schema()
    # Without the columns a dead row would look unsent and be published again: keep it out
    # of the relay's way as expired instead.
    outbox = sa.table(
        "outbox_messages",
        sa.column("dead_at", _time),
        sa.column("expired_at", _time),
        schema=schema,
    )
    op.execute(
        outbox.update().where(outbox.c.dead_at.is_not(None)).values(expired_at=outbox.c.dead_at)
    )
    # SQLite rebuilds the table to drop a column: the partial indexes go first and are made
    # again afterwards, so that their conditions are not lost in the copy.
    op.drop_index("ix_outbox_messages_dead", table_name="outbox_messages", schema=schema)
    _drop_unsent_indexes(schema)
    with op.batch_alter_table("outbox_messages", schema=schema) as batch:
        batch.drop_column("dead_reason")
        batch.drop_column("dead_at")
    _create_unsent_indexes(schema, _UNSENT_BEFORE)
