"""The shipped migrations yield exactly the declared metadata, and revert cleanly."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.schema import CreateTable

from outbox_inbox import ConfigurationError
from outbox_inbox.migrate import alembic_config, compared, downgrade, upgrade
from outbox_inbox.tables import VERSION_TABLE, build_tables


def _diff(db_url: str, schema: str) -> list[Any]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_name": lambda name, type_, _parent: (
                        type_ != "schema" or name == schema
                    ),
                    "include_object": lambda obj, name, type_, _r, _c: compared(
                        obj, name, type_, conn.dialect.name == "sqlite"
                    ),
                    "compare_type": True,
                    "compare_server_default": True,
                },
            )
            return list(compare_metadata(context, build_tables(schema).metadata))
    finally:
        engine.dispose()


@pytest.mark.parametrize("schema", ["outbox_inbox", "svc_orders"])
def test_upgrade_head_yields_exactly_the_declared_metadata(db_url: str, schema: str) -> None:
    upgrade(alembic_config(db_url, schema=schema))
    assert _diff(db_url, schema) == []


def test_upgrade_twice_is_a_no_op_and_downgrade_base_removes_everything(db_url: str) -> None:
    config = alembic_config(db_url, schema="svc")
    upgrade(config)
    upgrade(config)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names(schema="svc"))
        assert {"outbox_messages", "inbox_messages", "inbox_deliveries", VERSION_TABLE} <= tables
        downgrade(config, "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names(schema="svc")) == {VERSION_TABLE}
            functions = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'svc'"
            ).scalar()
        assert functions == 0
        upgrade(config)  # and up again from base
        assert _diff(db_url, "svc") == []
    finally:
        engine.dispose()


def test_the_service_version_table_is_left_alone(db_url: str) -> None:
    """A service's own alembic_version never collides with the library's history."""
    upgrade(alembic_config(db_url, schema="public"))
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names(schema="public"))
    finally:
        engine.dispose()
    assert "alembic_version" not in tables
    assert VERSION_TABLE in tables


def test_invalid_schema_is_refused_before_touching_the_database() -> None:
    with pytest.raises(ConfigurationError):
        alembic_config("postgresql+psycopg://127.0.0.1:1/none", schema="x; drop schema public")


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_downgrading_below_0003_keeps_a_dead_outbox_row_from_being_published_again(
    db_url: str, tmp_path: Any, dialect: str
) -> None:
    """Without dead_at a dead row would look unsent: it is kept out of the relay's way."""
    url = db_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    schema = "outbox_inbox" if dialect == "postgresql" else ""
    table = f"{schema}.outbox_messages" if schema else "outbox_messages"
    config = alembic_config(url, schema="outbox_inbox")
    upgrade(config)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for message_id, dead in (
                ("7d1f2c1e-0000-4000-8000-000000000001", True),
                ("7d1f2c1e-0000-4000-8000-000000000002", False),
            ):
                conn.execute(
                    text(
                        f"INSERT INTO {table} (message_id, kind, exchange, routing_key, payload,"
                        " headers, dead_at, dead_reason)"
                        " VALUES (:m, 'event', 'events', 'a.b', '{}', '{}', :dead_at, :reason)"
                    ),
                    {
                        "m": message_id if dialect == "postgresql" else message_id.replace("-", ""),
                        "dead_at": datetime.now(UTC) if dead else None,
                        "reason": "refused" if dead else None,
                    },
                )
        downgrade(config, "0002")
        with engine.connect() as conn:
            got = (
                conn.execute(text(f"SELECT expired_at IS NOT NULL FROM {table} ORDER BY id"))
                .scalars()
                .all()
            )
            columns = {
                c["name"]
                for c in inspect(conn).get_columns("outbox_messages", schema=schema or None)
            }
        assert got == [True, False]
        assert "dead_at" not in columns
        upgrade(config)
        if dialect == "postgresql":
            assert _diff(url, "outbox_inbox") == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_check_constraints_have_the_declared_names_in_every_partition_and_revert(
    db_url: str, tmp_path: Any, dialect: str
) -> None:
    url = db_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    config = alembic_config(url, schema="ck_names")
    upgrade(config)
    engine = create_engine(url)
    metadata = build_tables("ck_names" if dialect == "postgresql" else None).metadata
    ddl = " ".join(
        str(CreateTable(t).compile(dialect=engine.dialect)) for t in metadata.tables.values()
    )
    declared = set(re.findall(r"CONSTRAINT (ck_\w+)", ddl))

    def names() -> set[str]:
        with engine.connect() as conn:
            if dialect == "sqlite":
                found = conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")
                ddl = " ".join(found.scalars())
                return set(re.findall(r"CONSTRAINT (ck_\w+)", ddl))
            return set(  # the partitions' too
                conn.exec_driver_sql(
                    "SELECT conname FROM pg_constraint c JOIN pg_namespace n"
                    " ON n.oid = c.connamespace WHERE n.nspname = 'ck_names' AND contype = 'c'"
                    " AND conname LIKE 'ck%%'"
                ).scalars()
            )

    try:
        assert (
            names()
            == declared
            == {
                "ck_outbox_messages_kind",
                "ck_inbox_messages_kind",
                "ck_inbox_messages_status",
                "ck_archive_files_source_table",
            }
        )
        downgrade(config, "0006")  # the names the earlier revisions made and revert
        assert names() == {
            "ck_outbox_messages_ck_outbox_messages_kind",
            "ck_inbox_messages_ck_inbox_messages_kind",
            "ck_inbox_messages_ck_inbox_messages_status",
            "ck_archive_files_ck_archive_files_source_table",
        }
        upgrade(config)
        assert names() == declared
        downgrade(config, "base")
    finally:
        engine.dispose()
