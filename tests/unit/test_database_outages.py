"""Which database errors are an outage the roles wait out, and which are the statement's own.

`errors.database_unreachable` decides it for the worker (a handler's write that fails so is not
the message's fault), for `storage_error` (DatabaseUnavailable or StorageError) and so for
what the caller of the outbox is told. The errors are built as psycopg raises them for each
SQLSTATE, wrapped as SQLAlchemy wraps them.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.exc import DBAPIError

from outbox_inbox.errors import DatabaseUnavailable, database_unreachable, storage_error


def _raised(sqlstate: str, text: str) -> DBAPIError:
    """The SQLAlchemy error of a statement that failed with `sqlstate`."""
    error = psycopg.errors.lookup(sqlstate)(text)
    return DBAPIError.instance("INSERT ...", None, error, psycopg.Error)


@pytest.mark.parametrize(
    ("sqlstate", "text"),
    [
        ("53100", 'could not extend file "base/16384/16394": No space left on device'),
        ("53200", "out of memory"),
        ("53300", "sorry, too many clients already"),
        ("57P01", "terminating connection due to administrator command"),
    ],
)
def test_a_server_out_of_disk_memory_or_connections_is_an_outage(sqlstate: str, text: str) -> None:
    error = _raised(sqlstate, text)
    assert database_unreachable(error)
    assert isinstance(storage_error(error, "writing to the outbox"), DatabaseUnavailable)


@pytest.mark.parametrize(
    ("sqlstate", "text"),
    [
        ("53400", "configuration limit exceeded"),  # a setting: waiting does not change it
        ("23505", "duplicate key value violates unique constraint"),
        ("22P02", "invalid input syntax for type uuid"),
    ],
)
def test_a_limit_of_the_configuration_or_a_refused_value_is_not_an_outage(
    sqlstate: str, text: str
) -> None:
    error = _raised(sqlstate, text)
    assert not database_unreachable(error)
    assert not isinstance(storage_error(error, "writing to the outbox"), DatabaseUnavailable)
