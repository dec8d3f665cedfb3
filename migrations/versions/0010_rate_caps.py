"""Rate caps: a partial index of the finished inbox rows by type and time.

``ix_inbox_messages_finished`` (routing_key, processed_at) of the rows with a
``processed_at`` (processed or dead): a claim counts a rate-capped type's rows finished within
its period from it. On PostgreSQL it is built on the partitioned inbox and its partitions (the
table is locked against writes while it is built).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_NAME = "ix_inbox_messages_finished"
_WHERE = "processed_at IS NOT NULL"


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_index(
        _NAME,
        "inbox_messages",
        ["routing_key", "processed_at"],
        schema=_schema(),
        postgresql_where=sa.text(_WHERE),
        sqlite_where=sa.text(_WHERE),
    )


def downgrade() -> None:
    op.drop_index(_NAME, table_name="inbox_messages", schema=_schema())
