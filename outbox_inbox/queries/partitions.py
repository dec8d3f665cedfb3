"""The statements of the partition maintenance (`outbox_inbox.partitions`): the catalog reads,
the DDL of a partition, the maintenance lock, the check that a partition holds no unfinished
row. PostgreSQL only. DDL takes no bound parameters: the only names placed into it are the
library's validated schema and table names and the partition names and bounds that
`outbox_inbox.partitions` computed — never input."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Table, column, exists, or_, select, table, text

from ..tables import DEAD, PARKED, PENDING, Tables, outbox_unsent
from .archive import try_xact_lock
from .operations import dead_since


def _quote(conn: Connection, name: str) -> str:
    return str(conn.dialect.identifier_preparer.quote(name))


def _literal(moment: datetime | None) -> str:
    """A partition bound (None: MINVALUE)."""
    return "MINVALUE" if moment is None else f"'{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}+00'"


def _ddl(conn: Connection, statement: str, schema: str, **names: str) -> None:
    """Run `statement` with ``{s}`` the schema and each of `names`, quoted by the dialect."""
    quoted = {key: _quote(conn, value) for key, value in names.items()}
    conn.execute(text(statement.format(s=_quote(conn, schema), **quoted)))


def schema_catalog(conn: Connection, schema: str) -> list[Any]:
    """A row per table of `schema`: name, kind ('p' partitioned, 'r' plain), parent (of a
    partition, else NULL), bound (its expression), pending (a detach), rows (estimated, -1 if
    never analysed), size (of a partition: bytes with indexes and TOAST), now (the clock)."""
    return list(
        conn.execute(
            text(
                "SELECT c.relname AS name, c.relkind AS kind, p.relname AS parent, "
                "pg_get_expr(c.relpartbound, c.oid) AS bound, i.inhdetachpending AS pending, "
                "c.reltuples AS rows, CASE WHEN p.oid IS NOT NULL THEN "
                "pg_total_relation_size(c.oid) END AS size, now() AS now "
                "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "LEFT JOIN pg_inherits i ON i.inhrelid = c.oid "
                "LEFT JOIN pg_class p ON p.oid = i.inhparent "
                "WHERE n.nspname = :schema AND c.relkind IN ('r', 'p')"
            ),
            {"schema": schema},
        ).all()
    )


def check_constraints(conn: Connection, schema: str, name: str) -> list[str]:
    """The definitions of the CHECK constraints of table `schema`.`name`."""
    query = "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = "
    name = f"{_quote(conn, schema)}.{_quote(conn, name)}"
    return list(
        conn.execute(text(query + "to_regclass(:n) AND contype = 'c'"), {"n": name}).scalars()
    )


def create_partition(
    conn: Connection, schema: str, parent: str, name: str, start: datetime, end: datetime
) -> None:
    """Create `name` alone, give it its unique index on message_id, and attach it to `parent`
    for [start, end): ``ATTACH PARTITION`` takes a lock writers do not wait for."""
    # INCLUDING CONSTRAINTS: ATTACH refuses a table without the parent's CHECKs (the
    # outbox's `kind`), and the migration's week of partitions runs out after 7 days.
    like = "CREATE TABLE {s}.{name} (LIKE {s}.{parent} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    _ddl(conn, like, schema, name=name, parent=parent)
    index = "CREATE UNIQUE INDEX {index} ON {s}.{name} (message_id)"
    _ddl(conn, index, schema, index=f"{name}_message_id", name=name)
    attach(conn, schema, parent, name, start, end)


def attach(
    conn: Connection, schema: str, parent: str, name: str, lower: datetime | None, upper: datetime
) -> None:
    """Attach table `name` to `parent` for [lower, upper) (`lower` None: MINVALUE)."""
    bounds = f"FROM ({_literal(lower)}) TO ({_literal(upper)})"
    statement = "ALTER TABLE {s}.{parent} ATTACH PARTITION {s}.{name} FOR VALUES " + bounds
    _ddl(conn, statement, schema, parent=parent, name=name)


def detach(conn: Connection, schema: str, parent: str, name: str, *, finalize: bool) -> None:
    """``DETACH PARTITION … CONCURRENTLY`` (writers and readers go on), or ``… FINALIZE``."""
    how = "FINALIZE" if finalize else "CONCURRENTLY"
    statement = "ALTER TABLE {s}.{parent} DETACH PARTITION {s}.{name} " + how
    _ddl(conn, statement, schema, parent=parent, name=name)


def drop_table(conn: Connection, schema: str, name: str) -> None:
    _ddl(conn, "DROP TABLE {s}.{name}", schema, name=name)


def try_maintenance_lock(conn: Connection, schema: str) -> bool:
    """Take the maintenance lock of `schema` if it is free: a transaction-level advisory lock,
    held until `conn`'s transaction ends, which no idle timeout ends early."""
    return try_xact_lock(conn, f"outbox_inbox.partitions.{schema}")


def partition_rows(tables: Tables, parent: str, name: str) -> Table:
    """The partition `name` (attached or not) as a table with its parent's columns."""
    source = tables.outbox if parent == "outbox_messages" else tables.inbox
    return table(  # type: ignore[return-value]
        name, *(column(c.name, c.type) for c in source.c), schema=tables.schema
    )


def unfinished(parent: str, rows: Any, dead_cutoff: datetime | None) -> Any:
    """The rows of `parent` that keep their partition: work still to do, and dead or parked
    rows that died after `dead_cutoff` (None: dead rows are kept for ever)."""
    if parent == "outbox_messages":
        work, dead = outbox_unsent(rows), rows.c.dead_at.is_not(None)
    else:
        work, dead = rows.c.status == PENDING, rows.c.status.in_([DEAD, PARKED])
    return or_(work, dead if dead_cutoff is None else dead & (dead_since(rows) >= dead_cutoff))


def holds_unfinished(conn: Connection, rows: Table, parent: str, dead_cutoff: Any) -> bool:
    """Whether partition `rows` of `parent` holds a row that keeps it (`unfinished`)."""
    query = select(exists().where(unfinished(parent, rows, dead_cutoff)))
    return bool(conn.execute(query).scalar())
