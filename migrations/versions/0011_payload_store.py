"""The claim check's PostgreSQL payload store: the ``payloads`` table.

A payload sent by reference (outbox_inbox.claim_check), written in the sender's transaction
and removed after the retention. Not partitioned: its rows are few and large, and deleted by
age.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "payloads",
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
        sa.PrimaryKeyConstraint("key", name="pk_payloads"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("payloads", schema=_schema())
