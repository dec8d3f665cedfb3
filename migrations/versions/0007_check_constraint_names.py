"""CHECK constraints named once: ``ck_inbox_messages_kind``, not
``ck_inbox_messages_ck_inbox_messages_kind``.

Revisions 0001, 0002 and 0004 gave their CHECK constraints the whole name, and the metadata's
naming convention (``ck_<table>_<name>``, outbox_inbox.tables) prefixed it a second time. This
revision renames them to the names the declared metadata gives; the earlier revisions keep
making (and reverting) the names they always made. A revision names a CHECK constraint by its
short name (``kind``), or passes a whole one through ``op.f()``.

On PostgreSQL a rename of the partitioned table's constraint renames it in every partition; on
SQLite the table is rebuilt (its one descending index made again, which a rebuild would make
ascending).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

#: Each table's CHECK constraints: short name, condition (at revision 0006).
_CHECKS = {
    "outbox_messages": {"kind": "kind IN ('command', 'event')"},
    "inbox_messages": {
        "kind": "kind IN ('command', 'event')",
        "status": "status IN ('pending', 'processed', 'dead', 'parked')",
    },
    "archive_files": {"source_table": "source_table IN ('outbox', 'inbox')"},
}


def _rename(doubled_to_single: bool) -> None:
    bind = op.get_bind()
    for table, checks in _CHECKS.items():
        names = {
            short: (f"ck_{table}_ck_{table}_{short}", f"ck_{table}_{short}") for short in checks
        }
        if not doubled_to_single:
            names = {short: (new, old) for short, (old, new) in names.items()}
        if bind.dialect.name == "postgresql":
            quote = bind.dialect.identifier_preparer.quote
            s = bind.dialect.identifier_preparer.quote_schema(
                context.config.attributes["outbox_inbox_schema"]
            )
            for old, new in names.values():  # the library's own names: no input here
                op.execute(
                    f"ALTER TABLE {s}.{table} RENAME CONSTRAINT {quote(old)} TO {quote(new)}"
                )
            continue
        with op.batch_alter_table(table, recreate="always") as batch:
            for short, (old, new) in names.items():
                batch.drop_constraint(op.f(old), type_="check")
                batch.create_check_constraint(op.f(new), sa.text(checks[short]))
        if table == "inbox_messages":
            op.drop_index("ix_inbox_messages_pending", table_name=table)
            op.create_index(
                "ix_inbox_messages_pending",
                table,
                [sa.text("priority DESC"), "id"],
                sqlite_where=sa.text("status = 'pending'"),
            )


def upgrade() -> None:
    _rename(True)


def downgrade() -> None:
    _rename(False)
