"""Running the shipped alembic migrations, from code and from `outbox-inbox db`."""

from __future__ import annotations

import importlib
import io
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, inspect
from sqlalchemy.exc import SQLAlchemyError

from .config import validate_identifier
from .errors import StorageError
from .logsafe import mask_url
from .tables import build_tables

DEFAULT_SCHEMA = "outbox_inbox"


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
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise StorageError(f"migration {action} on {mask_url(url)} failed: {first}") from exc


def upgrade(config: Config, revision: str = "heads") -> None:
    """Apply migrations up to `revision`."""
    _run("upgrade", config, revision)


def downgrade(config: Config, revision: str) -> None:
    """Revert migrations down to `revision` (``base`` removes the tables)."""
    _run("downgrade", config, revision)


def tables_exist(connection: Connection, schema: str | None) -> bool:
    """True when the tables of the latest revision exist in `schema`."""
    names = set(inspect(connection).get_table_names(schema=schema))
    wanted = {table.name for table in build_tables(schema or None).metadata.tables.values()}
    return wanted <= names
