"""Duplicate counter, subscriptions and the archive's file journal (message history).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_time = sa.DateTime(timezone=True)


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.add_column(
        "inbox_deliveries",
        sa.Column("duplicates", sa.Integer(), server_default=sa.text("0"), nullable=False),
        schema=schema,
    )
    op.create_table(
        "subscriptions",
        sa.Column("service", sa.String(255), nullable=False),
        sa.Column("exchange", sa.String(255), nullable=False),
        sa.Column("pattern", sa.String(255), nullable=False),
        sa.Column("subscribed_at", _time, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("service", "exchange", "pattern", name="pk_subscriptions"),
        schema=schema,
    )
    op.create_table(
        "archive_files",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("source_table", sa.String(16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("created_at", _time, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint(
            "source_table IN ('outbox', 'inbox')", name="ck_archive_files_source_table"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_archive_files"),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_table("archive_files", schema=schema)
    op.drop_table("subscriptions", schema=schema)
    with op.batch_alter_table("inbox_deliveries", schema=schema) as batch:
        batch.drop_column("duplicates")
