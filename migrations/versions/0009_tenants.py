"""Tenants: the inbox's ``tenant`` column, and the fair claim's index by type and tenant.

``tenant`` (text, not null, '' for none) holds a received message's ``x-tenant`` header; adding
it with a constant default is a change of the catalog only on PostgreSQL 11 and later.
``ix_inbox_messages_pending_type`` is built again on (routing_key, tenant, priority DESC, id)
of the pending rows: a fair claim serves each type's tenants in turn. On PostgreSQL it is
built on the partitioned inbox and its partitions (the table is locked against writes while
it is built).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_INDEX = "ix_inbox_messages_pending_type"
_PENDING = sa.text("status = 'pending'")


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def _index(*columns: str) -> None:
    op.drop_index(_INDEX, table_name="inbox_messages", schema=_schema())
    op.create_index(
        _INDEX,
        "inbox_messages",
        [*columns, sa.text("priority DESC"), "id"],
        schema=_schema(),
        postgresql_where=_PENDING,
        sqlite_where=_PENDING,
    )


def upgrade() -> None:
    tenant = sa.Column("tenant", sa.String(255), nullable=False, server_default=sa.text("''"))
    op.add_column("inbox_messages", tenant, schema=_schema())
    _index("routing_key", "tenant")


def downgrade() -> None:
    _index("routing_key")
    with op.batch_alter_table("inbox_messages", schema=_schema()) as batch:
        batch.drop_column("tenant")
