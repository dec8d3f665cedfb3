"""Alembic environment of outbox_inbox.

The schema comes from ``config.attributes["outbox_inbox_schema"]`` (set by
`outbox_inbox.migrate`) or ``-x schema=NAME``; the version table is ``outbox_inbox_version``
in that schema, so it never collides with a service's own alembic history. A connection in
``config.attributes["connection"]`` is used as it is; otherwise one is opened from
``sqlalchemy.url``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, pool
from sqlalchemy.schema import CreateSchema

from outbox_inbox.migrate import schema_from_config
from outbox_inbox.tables import VERSION_TABLE, build_tables

config = context.config
schema = schema_from_config(config, context.get_x_argument(as_dictionary=True))
config.attributes["outbox_inbox_schema"] = schema
target_metadata = build_tables(schema).metadata


def _run(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
        # exists; a migration role given a schema of its own has no such right
        # (docs/security.md).
        if not connection.dialect.has_schema(connection, schema):
            connection.execute(CreateSchema(schema, if_not_exists=True))
        connection.commit()
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema if connection.dialect.name == "postgresql" else None,
        include_schemas=False,
        compare_type=True,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass --db-url or set OUTBOX_INBOX_DB_URL")
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
