"""Every PostgreSQL connection the library's engines open has client-side bounds, and a bound
the db_url sets itself wins (database.CLIENT_BOUNDS; docs/failures.md, "A partition from
PostgreSQL").

What is checked is what reaches the driver: the parameters of the engine's connect call, as
SQLAlchemy's ``do_connect`` event hands them over (the URL's query and the engine's
``connect_args`` merged), caught there before any connection is attempted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import event

from outbox_inbox.aio import worker_engine
from outbox_inbox.database import CLIENT_BOUNDS, connect

URL = "postgresql+psycopg://someone@127.0.0.1:9/nowhere"


class _Caught(Exception):
    """Raised by the do_connect hook: the parameters are known, nothing is connected."""


def _parameters(engine: Any) -> dict[str, Any]:
    """The keyword parameters `engine` hands psycopg for a new connection."""
    seen: dict[str, Any] = {}
    sync_engine = getattr(engine, "sync_engine", engine)

    @event.listens_for(sync_engine, "do_connect")
    def catch(_dialect: Any, _record: Any, _args: Any, params: dict[str, Any]) -> None:
        seen.update(params)
        raise _Caught

    with pytest.raises(_Caught):
        if sync_engine is engine:
            engine.connect()
        else:
            asyncio.run(engine.connect().start())
    return seen


def test_the_service_engine_bounds_every_connection_it_opens() -> None:
    params = _parameters(connect(URL).engine)
    assert {key: params.get(key) for key in CLIENT_BOUNDS} == CLIENT_BOUNDS
    assert params["tcp_user_timeout"] == 10_000 and params["connect_timeout"] == 5


def test_the_asyncio_worker_engine_bounds_every_connection_it_opens() -> None:
    params = _parameters(worker_engine(URL))
    assert {key: params.get(key) for key in CLIENT_BOUNDS} == CLIENT_BOUNDS


def test_a_bound_the_db_url_sets_wins_and_the_others_still_apply() -> None:
    url = URL + "?connect_timeout=3&tcp_user_timeout=1000&keepalives=0"
    for engine in (connect(url).engine, worker_engine(url)):
        params = _parameters(engine)
        assert (params["connect_timeout"], params["tcp_user_timeout"]) == ("3", "1000")
        assert params["keepalives"] == "0"
        assert params["keepalives_idle"] == CLIENT_BOUNDS["keepalives_idle"]


def test_pgconnect_timeout_in_the_environment_wins_over_the_library_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "4")
    params = _parameters(connect(URL).engine)
    assert "connect_timeout" not in params  # libpq reads the variable itself
    assert params["tcp_user_timeout"] == CLIENT_BOUNDS["tcp_user_timeout"]
