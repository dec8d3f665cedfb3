"""Fair claims and concurrency caps: two partial indexes of the pending inbox rows.

``ix_inbox_messages_pending_type`` (routing_key, priority DESC, id): the worker's claim reads
the types waiting and each type's rows in claim order from it. ``ix_inbox_messages_leased``
(routing_key) of the pending rows with a lease: a claim counts a capped type's rows in flight
from it. On PostgreSQL each is built on the partitioned inbox and its partitions (the table
is locked against writes while it is built).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: (name, columns, where)
_INDEXES: list[tuple[str, list[str | sa.TextClause], str]] = [
    (
        "ix_inbox_messages_pending_type",
        ["routing_key", sa.text("priority DESC"), "id"],
        "status = 'pending'",
    ),
    (
        "ix_inbox_messages_leased",
        ["routing_key"],
        "status = 'pending' AND locked_until IS NOT NULL",
    ),
]


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    for name, columns, where in _INDEXES:
        op.create_index(
            name,
            "inbox_messages",
            columns,
            schema=_schema(),
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    for name, _columns, _where in _INDEXES:
        op.drop_index(name, table_name="inbox_messages", schema=_schema())
