"""Outbox, inbox and delivery-counter tables, and the NOTIFY triggers.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = ("outbox_inbox",)
depends_on = None

_json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_bigid = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_time = sa.DateTime(timezone=True)


def _schema() -> str | None:
    schema: str = context.config.attributes["outbox_inbox_schema"]
    return schema if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    op.create_table(
        "outbox_messages",
        sa.Column("id", _bigid, sa.Identity(always=False), nullable=False),
        sa.Column("message_id", sa.Uuid(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("exchange", sa.String(255), nullable=False),
        sa.Column("routing_key", sa.String(255), nullable=False),
        sa.Column("payload", _json, nullable=False),
        sa.Column("headers", _json, nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("correlation_id", sa.String(255), nullable=True),
        sa.Column("causation_id", sa.String(255), nullable=True),
        sa.Column("key", sa.String(255), nullable=True),
        sa.Column("priority", sa.SmallInteger(), nullable=True),
        sa.Column("created_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("available_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("expires_at", _time, nullable=True),
        sa.Column("published_at", _time, nullable=True),
        sa.Column("expired_at", _time, nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.CheckConstraint("kind IN ('command', 'event')", name="ck_outbox_messages_kind"),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_messages"),
        sa.UniqueConstraint("message_id", name="uq_outbox_messages_message_id"),
        schema=schema,
    )
    op.create_index(
        "ix_outbox_messages_unpublished",
        "outbox_messages",
        ["id"],
        schema=schema,
        postgresql_where=sa.text("published_at IS NULL AND expired_at IS NULL"),
        sqlite_where=sa.text("published_at IS NULL AND expired_at IS NULL"),
    )
    op.create_index(
        "ix_outbox_messages_unpublished_key",
        "outbox_messages",
        ["key", "id"],
        schema=schema,
        postgresql_where=sa.text("published_at IS NULL AND expired_at IS NULL AND key IS NOT NULL"),
        sqlite_where=sa.text("published_at IS NULL AND expired_at IS NULL AND key IS NOT NULL"),
    )
    op.create_table(
        "inbox_messages",
        sa.Column("id", _bigid, sa.Identity(always=False), nullable=False),
        sa.Column("message_id", sa.Uuid(), nullable=False),
        sa.Column("source", sa.String(255), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("routing_key", sa.String(255), nullable=False),
        sa.Column("payload", _json, nullable=False),
        sa.Column("headers", _json, nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("correlation_id", sa.String(255), nullable=True),
        sa.Column("causation_id", sa.String(255), nullable=True),
        sa.Column("key", sa.String(255), nullable=True),
        sa.Column("priority", sa.SmallInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", _time, nullable=True),
        sa.Column("expires_at", _time, nullable=True),
        sa.Column("received_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("status", sa.String(16), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("finished", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("locked_until", _time, nullable=True),
        sa.Column("locked_by", sa.String(255), nullable=True),
        sa.Column("processed_at", _time, nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("dead_reason", sa.String(255), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'processed', 'dead')", name="ck_inbox_messages_status"
        ),
        sa.CheckConstraint("kind IN ('command', 'event')", name="ck_inbox_messages_kind"),
        sa.PrimaryKeyConstraint("id", name="pk_inbox_messages"),
        sa.UniqueConstraint("message_id", name="uq_inbox_messages_message_id"),
        schema=schema,
    )
    op.create_index(
        "ix_inbox_messages_pending",
        "inbox_messages",
        [sa.text("priority DESC"), "id"],
        schema=schema,
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        "ix_inbox_messages_pending_key",
        "inbox_messages",
        ["key", "id"],
        schema=schema,
        postgresql_where=sa.text("status = 'pending' AND key IS NOT NULL"),
        sqlite_where=sa.text("status = 'pending' AND key IS NOT NULL"),
    )
    op.create_table(
        "inbox_deliveries",
        sa.Column("message_id", sa.Uuid(), nullable=False),
        sa.Column("deliveries", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("first_seen_at", _time, server_default=sa.func.now(), nullable=False),
        sa.Column("last_seen_at", _time, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("message_id", name="pk_inbox_deliveries"),
        schema=schema,
    )
    if schema is not None:
        _create_notify_triggers(schema)


def _create_notify_triggers(schema: str) -> None:
    # The schema name was validated as an identifier and is quoted by the dialect: the only
    # name placed into these statements. A statement-level trigger notifies once per insert
    # statement, and PostgreSQL delivers it only when the inserting transaction commits.
    q = op.get_bind().dialect.identifier_preparer.quote_schema(schema)
    op.execute(
        f"CREATE FUNCTION {q}.outbox_inbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, ''); RETURN NULL; END $$"
    )
    for table in ("outbox_messages", "inbox_messages"):
        op.execute(
            f"CREATE TRIGGER {table}_notify AFTER INSERT ON {q}.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {q}.outbox_inbox_notify()"
        )


def downgrade() -> None:
    schema = _schema()
    if schema is not None:
        q = op.get_bind().dialect.identifier_preparer.quote_schema(schema)
        op.execute(f"DROP FUNCTION IF EXISTS {q}.outbox_inbox_notify() CASCADE")
    op.drop_table("inbox_deliveries", schema=schema)
    op.drop_index("ix_inbox_messages_pending_key", table_name="inbox_messages", schema=schema)
    op.drop_index("ix_inbox_messages_pending", table_name="inbox_messages", schema=schema)
    op.drop_table("inbox_messages", schema=schema)
    op.drop_index("ix_outbox_messages_unpublished_key", table_name="outbox_messages", schema=schema)
    op.drop_index("ix_outbox_messages_unpublished", table_name="outbox_messages", schema=schema)
    op.drop_table("outbox_messages", schema=schema)
