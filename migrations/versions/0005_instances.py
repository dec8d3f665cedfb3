"""Live instances and the handlers they run, for rolling deploys.

Adds ``instances``: one row per running worker of a service, with the handlers (kind, pattern,
versions) it runs and when it was last seen. A worker meeting a message it has no handler for
leaves it to a live worker that advertises one, instead of marking it dead.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_time = sa.DateTime(timezone=True)


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("service", sa.String(255), nullable=False),
        sa.Column("instance", sa.String(255), nullable=False),
        sa.Column("handlers", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=False),
        sa.Column("started_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("seen_at", _time, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("service", "instance", name="pk_instances"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("instances", schema=_schema())
