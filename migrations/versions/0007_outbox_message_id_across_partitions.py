"""The outbox's message_id unique across its partitions, as the inbox's is.

Since 0006 a unique index holds each partition of ``outbox_messages`` only: a second write of a
message id whose first row is in another partition (written the day before) was accepted. A
row trigger now checks every partition first, under a transaction-scoped advisory lock on the
message id (namespace 0x0B10, ``queries.roles.OUTBOX_ID_LOCK``): a concurrent writer of the
same id waits for the first one's commit, and its check, a statement of the trigger's own,
sees that row (READ COMMITTED, the default). A duplicate fails as a unique index fails:
SQLSTATE 23505, ``StorageError`` for the caller. Partitions made later get the trigger with
``ATTACH``. The write path sends the same one statement; SQLite keeps one plain table.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import context, op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_LOCK = 0x0B10


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = op.get_bind().dialect.identifier_preparer.quote_schema(
        context.config.attributes["outbox_inbox_schema"]
    )
    # The schema, a validated identifier quoted by the dialect, is the only name placed here.
    op.execute(
        f"CREATE FUNCTION {s}.outbox_inbox_one_message_id() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN "
        f"PERFORM pg_advisory_xact_lock({_LOCK}, hashtext(NEW.message_id::text)); "
        f"IF EXISTS (SELECT FROM {s}.outbox_messages WHERE message_id = NEW.message_id) THEN "
        "RAISE unique_violation USING MESSAGE = 'duplicate key value violates unique "
        "constraint \"uq_outbox_messages_message_id\"', DETAIL = 'Key (message_id)=(' "
        "|| NEW.message_id || ') already exists.'; "
        "END IF; RETURN NEW; END $$"
    )
    op.execute(
        f"CREATE TRIGGER outbox_messages_one_message_id BEFORE INSERT ON {s}.outbox_messages "
        f"FOR EACH ROW EXECUTE FUNCTION {s}.outbox_inbox_one_message_id()"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = op.get_bind().dialect.identifier_preparer.quote_schema(
        context.config.attributes["outbox_inbox_schema"]
    )
    op.execute(f"DROP FUNCTION {s}.outbox_inbox_one_message_id() CASCADE")
