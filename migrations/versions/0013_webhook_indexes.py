"""Webhook deliveries apart from the relay's rows: two partial indexes of the unsent outbox.

``ix_outbox_messages_relayed`` (id) of the unsent rows that are not webhook deliveries: the
relay's claim reads it, so deliveries waiting for an endpoint (``exchange LIKE 'webhook:%'``)
never lie in its path. ``ix_outbox_messages_webhook`` (exchange, available_at, id) of the
unsent deliveries: an endpoint's claim reads its due rows alone. On PostgreSQL they are built
on the partitioned outbox and its partitions (the table is locked against writes while they
are built).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def _where(webhook: bool) -> sa.ColumnElement[bool]:
    unsent = sa.and_(*(sa.column(c).is_(None) for c in ("published_at", "expired_at", "dead_at")))
    hook = sa.column("exchange").like(sa.literal("webhook:%", literal_execute=True))
    return sa.and_(unsent, hook if webhook else ~hook)


def upgrade() -> None:
    for name, columns, webhook in (
        ("ix_outbox_messages_relayed", ["id"], False),
        ("ix_outbox_messages_webhook", ["exchange", "available_at", "id"], True),
    ):
        where = _where(webhook)
        op.create_index(
            name,
            "outbox_messages",
            columns,
            schema=_schema(),
            postgresql_where=where,
            sqlite_where=where,
        )


def downgrade() -> None:
    for name in ("ix_outbox_messages_webhook", "ix_outbox_messages_relayed"):
        op.drop_index(name, table_name="outbox_messages", schema=_schema())
