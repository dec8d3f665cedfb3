"""The shipped alembic migrations, from code and from `outbox-inbox db` (docs/cli.md, "db")."""

from __future__ import annotations

import importlib
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect
from sqlalchemy.exc import SQLAlchemyError

from .config import validate_identifier
from .database import DEFAULT_SCHEMA, tables_for
from .errors import StorageError, first_line, storage_error
from .logsafe import mask_url
from .partitions import is_partition
from .queries.operations import privileges_held
from .tables import VERSION_TABLE


def script_location() -> str:
    """Directory of the shipped migrations (inside the installed package)."""
    package = importlib.import_module("outbox_inbox.migrations")
    return str(Path(package.__file__ or "").parent)


def schema_from_config(config: Config, x_arguments: dict[str, str]) -> str:
    """The schema to migrate: config attributes, then ``-x schema=NAME``, then the default."""
    schema = config.attributes.get("outbox_inbox_schema")
    if schema is None:
        schema = x_arguments.get("schema", DEFAULT_SCHEMA)
    return validate_identifier(str(schema))


def alembic_config(
    db_url: str | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    connection: Connection | None = None,
    stdout: Any = None,
) -> Config:
    """An alembic Config for the shipped migrations on `db_url` or an open `connection`."""
    config = Config(stdout=stdout or io.StringIO())
    config.set_main_option("script_location", script_location())
    if db_url:
        # ConfigParser treats % as interpolation; URLs may contain %-escapes.
        config.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    config.attributes["outbox_inbox_schema"] = validate_identifier(schema)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def _run(action: str, config: Config, *args: Any) -> None:
    try:
        getattr(command, action)(config, *args)
    except SQLAlchemyError as exc:
        url = config.get_main_option("sqlalchemy.url") or ""
        failed = f"migration {action} on {mask_url(url)} failed"
        raise StorageError(f"{failed}: {first_line(exc)}") from exc


def upgrade(config: Config, revision: str = "heads") -> None:
    """Apply migrations up to `revision`."""
    _run("upgrade", config, revision)


def downgrade(config: Config, revision: str) -> None:
    """Revert migrations down to `revision` (``base`` removes the tables)."""
    _run("downgrade", config, revision)


def tables_exist(connection: Connection, schema: str | None) -> bool:
    """True when the outbox and inbox tables exist in `schema`: it was migrated (`current`
    tells whether to the latest revision; code newer than its schema fails the statements
    that need what is missing, as a storage error, until the upgrade)."""
    names = set(inspect(connection).get_table_names(schema=schema or None))
    return {"outbox_messages", "inbox_messages"} <= names


@dataclass(frozen=True)
class Revision:
    """One shipped migration."""

    revision: str
    down_revision: str | None
    head: bool
    message: str


@dataclass(frozen=True)
class Current:
    """Where a database's schema stands: its revisions and whether that is the newest."""

    schema: str
    revisions: tuple[str, ...]
    heads: tuple[str, ...]

    @property
    def up_to_date(self) -> bool:
        return bool(self.revisions) and set(self.revisions) == set(self.heads)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "revisions": list(self.revisions), "up_to_date": self.up_to_date}


def history() -> list[Revision]:
    """The migrations shipped in the package, newest first."""
    script = ScriptDirectory.from_config(alembic_config())
    return [
        Revision(r.revision, _down(r.down_revision), r.is_head, r.doc or "")
        for r in script.walk_revisions()
    ]


def heads() -> tuple[str, ...]:
    """The newest shipped revisions (one, unless the history branches)."""
    return tuple(sorted(ScriptDirectory.from_config(alembic_config()).get_heads()))


def current(connection: Connection, schema: str = DEFAULT_SCHEMA) -> Current:
    """The revisions `schema` is at on `connection` (reads only: creates no version table; on
    SQLite the database file itself). Raises StorageError when the database cannot be read."""
    where = tables_for(connection.engine.url, schema).metadata.schema
    try:
        context = MigrationContext.configure(
            connection, opts={"version_table": VERSION_TABLE, "version_table_schema": where}
        )
        revisions = tuple(sorted(context.get_current_heads()))
    except SQLAlchemyError as exc:
        raise storage_error(exc, "reading the migration version") from exc
    return Current(schema, revisions, heads())


def check(connection: Connection, schema: str = DEFAULT_SCHEMA) -> list[str]:
    """What differs between `schema`'s tables and the newest migration; empty when equal: the
    revision (not at head: nothing else is compared), then every difference alembic finds."""
    state = current(connection, schema)
    if not state.up_to_date:
        at = ", ".join(state.revisions) or "no revision"
        return [f"schema {schema} is at {at}, the newest is {', '.join(state.heads)}"]
    tables = tables_for(connection.engine.url, schema)
    where = tables.metadata.schema
    sqlite = where is None
    context = MigrationContext.configure(
        connection,
        opts={
            "include_schemas": not sqlite,
            "include_name": lambda name, type_, _parent: type_ != "schema" or name == where,
            "include_object": lambda obj, name, type_, _r, _c: compared(obj, name, type_, sqlite),
            "compare_type": True,
        },
    )
    try:
        found = compare_metadata(context, tables.metadata)
    except SQLAlchemyError as exc:
        raise storage_error(exc, "comparing the schema with the migrations") from exc
    return [_describe(diff) for diff in found]


def table_oids(connection: Connection, schema: str = DEFAULT_SCHEMA) -> dict[str, int]:
    """The library's tables now in `schema` (not its partitions nor the version table) by
    their PostgreSQL oid, new for a table a migration made again; empty on SQLite."""
    if connection.dialect.name != "postgresql":
        return {}
    found = inspect(connection)
    return {
        name: found.get_table_oid(name, schema)  # type: ignore[attr-defined]
        for name in found.get_table_names(schema=schema)
        if not is_partition(name) and name != VERSION_TABLE
    }


def runtime_grants(connection: Connection, role: str, schema: str = DEFAULT_SCHEMA) -> list[str]:
    """The GRANT statements that give `role`, a runtime role, the rights docs/security.md
    names that it lacks on `schema` (none on SQLite). Grants name tables: a table a migration
    adds or makes again is not covered by them unless default privileges were set. Raises
    StorageError, for a role that does not exist too."""
    if connection.dialect.name != "postgresql":
        return []
    tables = [f"{schema}.{name}" for name in sorted(table_oids(connection, schema))]
    wanted = [(t, right) for t in tables for right in ("SELECT", "INSERT", "UPDATE", "DELETE")]
    wanted += [(schema, "USAGE"), (f"{schema}.{VERSION_TABLE}", "SELECT")]
    try:
        held = privileges_held(connection, role, wanted)
    except SQLAlchemyError as exc:
        raise storage_error(exc, f"reading the privileges of {role}") from exc
    lacking: dict[str, list[str]] = {}
    for (name, right), has in zip(wanted, held, strict=True):
        if not has:
            lacking.setdefault(name if "." in name else f"SCHEMA {name}", []).append(right)
    return [f"GRANT {', '.join(rights)} ON {name} TO {role}" for name, rights in lacking.items()]


def compared(obj: Any, name: str | None, type_: str, sqlite: bool) -> bool:
    """What `check` compares: not the version table; on PostgreSQL not the partitions (made
    and dropped by the library, outbox_inbox.partitions) nor the message id's uniqueness,
    which a partitioned table keeps per partition (and the receiver across them)."""
    if type_ == "table" and (name == VERSION_TABLE or is_partition(name or "")):
        return False
    if type_ == "index" and is_partition(obj.table.name):
        return False
    return sqlite or not (type_ == "unique_constraint" and (name or "").endswith("_message_id"))


def _describe(diff: Any) -> str:
    """One line for one alembic difference (a tuple, or a list of them for a column)."""
    if isinstance(diff, list):
        return "; ".join(_describe(d) for d in diff)
    kind, *rest = diff
    names = [getattr(r, "name", None) or str(r) for r in rest if r is not None][:3]
    return f"{kind}: {', '.join(names)}"


def _down(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else ", ".join(value)


__all__ = ["alembic_config", "check", "current", "downgrade", "upgrade"]
