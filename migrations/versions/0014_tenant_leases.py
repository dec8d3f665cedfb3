"""The tenants fleet's leases: which relay or worker drains a tenant now, and until when.

Adds ``tenant_leases`` (service, role, tenant, holder, locked_until): a fleet thread holds a
tenant's row while it drains that tenant's outbox (role ``relay``) or inbox (``worker``),
renewed each batch on the database clock and deleted when done; a holder that died loses it
when ``locked_until`` passes (outbox_inbox.tenants).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "tenant_leases",
        sa.Column("service", sa.String(255), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("locked_until", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("service", "role", "tenant", name="pk_tenant_leases"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("tenant_leases", schema=_schema())
