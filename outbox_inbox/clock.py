"""The database clock as SQL: leases, delays and expiry are judged by it, never by a host clock.
`db_now()` and `db_now_plus(delta)` compile to PostgreSQL's ``now()`` (the transaction's start time)
and, on SQLite, to ``strftime`` of the current UTC time written the way SQLAlchemy stores datetimes
there (``YYYY-MM-DD HH:MM:SS.ffffff``), so the values compare correctly as text. `db_age(column)` is
the seconds from a time to the database clock, the one expression of an age: on SQLite through
``julianday``, since a time there is text and text minus text is not a span."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from sqlalchemy import DateTime, Float, bindparam
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.functions import FunctionElement

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """A duration as a user writes one (``90``, ``90s``, ``10m``, ``2h``, ``7d``, ``1w``,
    ``1.5h``); ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 30s, 10m, 2h or 7d")
    return timedelta(seconds=float(match[1]) * _UNITS[match[2] or "s"])


def as_timedelta(seconds: float | None) -> timedelta | None:
    """A setting in seconds as a timedelta; None (for ever) stays None."""
    return None if seconds is None else timedelta(seconds=seconds)


# SQLite's %f gives milliseconds; three zeros make the six digits SQLAlchemy writes.
_SQLITE_FORMAT = "%Y-%m-%d %H:%M:%f000"


class db_now(FunctionElement[Any]):  # noqa: N801 - reads as a SQL function
    """The current time of the database."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_now"


class db_now_plus(FunctionElement[Any]):  # noqa: N801 - reads as a SQL function
    """The current time of the database plus a `timedelta`."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_now_plus"

    def __init__(self, delta: timedelta | BindParameter[Any]) -> None:
        # Seconds as a float parameter: each dialect turns it into its own interval syntax,
        # and the value stays a parameter of the statement (compiled SQL is cached). A
        # statement built once passes its own named parameter, given at each execution.
        if isinstance(delta, BindParameter):
            super().__init__(delta)
        else:
            super().__init__(bindparam("seconds", delta.total_seconds(), type_=Float, unique=True))


class db_age(FunctionElement[Any]):  # noqa: N801 - reads as a SQL function
    """Seconds from a time (a column or expression) to the database clock, as a float."""

    type = Float()
    inherit_cache = True
    name = "db_age"


@compiles(db_now)
def _now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return f"strftime('{_SQLITE_FORMAT}', 'now')" if _sqlite(compiler) else "now()"


@compiles(db_now_plus)
def _now_plus(element: db_now_plus, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    if _sqlite(compiler):
        return f"strftime('{_SQLITE_FORMAT}', 'now', printf('%+f seconds', {seconds}))"
    return f"(now() + make_interval(secs => {seconds}))"


@compiles(db_age)
def _age(element: db_age, compiler: SQLCompiler, **kw: Any) -> str:
    time = compiler.process(element.clauses, **kw)
    if _sqlite(compiler):
        return f"((julianday('now') - julianday({time})) * 86400.0)"
    return f"extract(epoch FROM now() - {time})"


def _sqlite(compiler: SQLCompiler) -> bool:
    return compiler.dialect.name == "sqlite"
