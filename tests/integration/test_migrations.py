"""The shipped migrations yield exactly the declared metadata, and revert cleanly."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from outbox_inbox import ConfigurationError
from outbox_inbox.migrate import alembic_config, downgrade, upgrade
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
                    "include_object": lambda _obj, name, type_, _r, _c: (
                        not (type_ == "table" and name == VERSION_TABLE)
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
