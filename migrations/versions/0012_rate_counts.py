"""Rate caps counted per tenth of the period, not by reading the finished rows.

``inbox_rate_counts`` (routing_key, bucket, claimed): the rows a claim of a rate-capped type
took, added up per tenth of the rate's period (bucket: its start, milliseconds since 1970 on
the database clock). A claim sums at most eleven of them. ``ix_inbox_messages_finished``, which
the claim read instead (every row finished in the period) and every service paid an index
entry per finished row for, is dropped.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_WHERE = "processed_at IS NOT NULL"


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "inbox_rate_counts",
        sa.Column("routing_key", sa.String(255), nullable=False),
        sa.Column("bucket", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("claimed", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("routing_key", "bucket", name="pk_inbox_rate_counts"),
        schema=_schema(),
    )
    op.drop_index("ix_inbox_messages_finished", table_name="inbox_messages", schema=_schema())


def downgrade() -> None:
    op.create_index(
        "ix_inbox_messages_finished",
        "inbox_messages",
        ["routing_key", "processed_at"],
        schema=_schema(),
        postgresql_where=sa.text(_WHERE),
        sqlite_where=sa.text(_WHERE),
    )
    op.drop_table("inbox_rate_counts", schema=_schema())
