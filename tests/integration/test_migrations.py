"""The shipped migrations yield exactly the declared metadata, and revert cleanly."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import ProgrammingError
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


def test_db_upgrade_and_check_name_the_grants_a_runtime_role_granted_on_the_old_tables_lacks(
    db_url: str,
) -> None:
    """A runtime role granted on the tables of 0004 meets `instances` (0005) with `permission
    denied`; `db upgrade` names the tables it made, `db check --runtime-role` the missing
    GRANTs, which, run as printed, make the role whole."""
    from click.testing import CliRunner

    from outbox_inbox.cli.db import db

    role = f"rt_{uuid.uuid4().hex[:8]}"
    admin = create_engine(db_url)
    upgrade(alembic_config(db_url), "0004")
    names = set(inspect(admin).get_table_names("outbox_inbox")) - {VERSION_TABLE}
    old = ", ".join(f"outbox_inbox.{name}" for name in sorted(names))
    with admin.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role}"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA outbox_inbox TO {role}"))
        conn.execute(text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {old} TO {role}"))
        conn.execute(text(f"GRANT SELECT ON outbox_inbox.{VERSION_TABLE} TO {role}"))
    runner = CliRunner()
    try:
        upgraded = runner.invoke(db, ["upgrade", "--db-url", db_url])
        assert upgraded.exit_code == 0, upgraded.output
        made = (
            "tables made: inbox_messages, inbox_rate_counts, instances, outbox_messages, payloads,"
            " tenant_leases;"
        )
        assert f"{made} a runtime role needs" in upgraded.output, upgraded.output
        with admin.begin() as conn:
            conn.execute(text(f"SET LOCAL ROLE {role}"))
            with pytest.raises(ProgrammingError, match="permission denied"):
                conn.execute(text("SELECT count(*) FROM outbox_inbox.instances"))
        checked = runner.invoke(db, ["check", "--db-url", db_url, "--runtime-role", role])
        assert checked.exit_code == 4, checked.output
        # 0005 added instances; 0006 made the message tables again, partitioned; 0011 added
        # payloads, 0012 inbox_rate_counts, 0014 tenant_leases.
        grants = [
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_inbox.{table} TO {role}"
            for table in (
                "inbox_messages",
                "inbox_rate_counts",
                "instances",
                "outbox_messages",
                "payloads",
                "tenant_leases",
            )
        ]
        assert checked.output.count("lacks:") == 6, checked.output
        assert all(f"lacks: {grant}\n" in checked.output for grant in grants), checked.output
        with admin.begin() as conn:
            for grant in grants:
                conn.execute(text(grant))
        checked = runner.invoke(db, ["check", "--db-url", db_url, "--runtime-role", role])
        assert checked.exit_code == 0, checked.output
        upgraded = runner.invoke(db, ["upgrade", "--db-url", db_url, "--runtime-role", role])
        assert upgraded.exit_code == 0 and "lacks" not in upgraded.output, upgraded.output
        with admin.begin() as conn:
            conn.execute(text(f"SET LOCAL ROLE {role}"))
            assert conn.scalar(text("SELECT count(*) FROM outbox_inbox.instances")) == 0
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()
