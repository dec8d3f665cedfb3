"""A LISTEN that lands on a pooled server connection is taken back from that very connection.

Behind PgBouncer in transaction mode a role's LISTEN registers on whichever server connection
the pooler picked, and stays there for the next client of that connection unless the waker
takes it back (outbox_inbox.waker). These tests check the pool afterwards: every server
connection of it, held at once by clients of its own, lists no channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine

from outbox_inbox import waker as waker_module
from outbox_inbox.waker import Waker, psycopg_conninfo, release_listen

from .bouncer import PgBouncerServer
from .conftest import POOL_SIZE, churn

CHANNEL = "orders.inbox_messages"
LISTEN = sql.SQL("LISTEN {}; SELECT pg_backend_pid()").format(sql.Identifier(CHANNEL))
UNLISTEN = sql.SQL("UNLISTEN {}; SELECT pg_backend_pid()").format(sql.Identifier(CHANNEL))


def _pooled(bouncer: PgBouncerServer, db_url: str) -> str:
    return bouncer.url(db_url).replace("+psycopg", "")


def _listening_in_pool(conninfo: str) -> list[tuple[int, int]]:
    """(backend pid, channels it listens on and advisory locks it holds) of every server
    connection of the pool: one client in a transaction per server connection, so that each
    is a different one. Either would stay with the server connection for its next clients."""
    clients = [psycopg.connect(conninfo) for _ in range(POOL_SIZE)]
    try:
        seen = []
        for client in clients:
            row = client.execute(
                "SELECT pg_backend_pid(), (SELECT count(*) FROM pg_listening_channels())"
                " + (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                " AND pid = pg_backend_pid())"
            ).fetchone()
            assert row is not None
            seen.append((int(row[0]), int(row[1])))
        for client in clients:
            client.rollback()
    finally:
        for client in clients:
            client.close()
    assert len({pid for pid, _ in seen}) == POOL_SIZE, seen
    return seen


def test_release_listen_finds_the_registration_under_the_servers_used_since(
    db_url: str, bouncers: dict[str, PgBouncerServer]
) -> None:
    """The registration's server connection is the last of the pool's idle ones to be handed
    out again; the LISTEN connection's own UNLISTEN runs elsewhere, release_listen does not."""
    conninfo = _pooled(bouncers["transaction"], db_url)
    with psycopg.connect(conninfo, autocommit=True) as listener:
        cursor = listener.execute(LISTEN)
        cursor.nextset()
        row = cursor.fetchone()
        assert row is not None
        registered = int(row[0])

        # Every server connection in a transaction; the registration's is given back first,
        # so that the others lie above it in PgBouncer's last-used-first list of idle ones.
        holders = [psycopg.connect(conninfo) for _ in range(POOL_SIZE)]
        pids = []
        for holder in holders:
            got = holder.execute("SELECT pg_backend_pid()").fetchone()
            assert got is not None
            pids.append(int(got[0]))
        assert registered in pids
        order = sorted(range(POOL_SIZE), key=lambda i: pids[i] != registered)
        for i in order:
            holders[i].rollback()
        for holder in holders:
            holder.close()

        cursor = listener.execute(UNLISTEN)
        cursor.nextset()
        row = cursor.fetchone()
        assert row is not None and int(row[0]) != registered, "precondition: UNLISTEN ran elsewhere"
        assert (registered, 1) in _listening_in_pool(conninfo), "precondition: still registered"

        engine = create_engine(
            bouncers["transaction"].url(db_url), connect_args={"prepare_threshold": None}
        )
        try:
            assert release_listen(conninfo, CHANNEL, registered, probe=engine) is True
        finally:
            engine.dispose()
    assert all(count == 0 for _, count in _listening_in_pool(conninfo))


def test_release_listen_is_done_when_the_registrations_server_connection_is_gone(
    db_url: str, bouncers: dict[str, PgBouncerServer]
) -> None:
    """A pooler that closed the server connection (server_lifetime, a restart) closed its
    registration with it: release_listen says so at once instead of searching the pool."""
    conninfo = _pooled(bouncers["transaction"], db_url)
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as direct:
        row = direct.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        gone = int(row[0])
    engine = create_engine(
        bouncers["transaction"].url(db_url), connect_args={"prepare_threshold": None}
    )
    try:
        started = time.monotonic()
        assert release_listen(conninfo, CHANNEL, gone, probe=engine) is True
        assert time.monotonic() - started < waker_module.RELEASE_WAIT
    finally:
        engine.dispose()


def test_wakers_started_together_on_a_cold_transaction_pool_leave_no_listen_behind(
    db_url_factory: Callable[[], str], bouncers: dict[str, PgBouncerServer]
) -> None:
    """Four roles' wakers probing at once while the pool opens its server connections, under
    a steady load of other transactions: each decides to poll, and no server connection of the
    pool is left listening. Three rounds, each on a database (so a pool) of its own."""
    leaked = []
    for _ in range(3):
        db_url = db_url_factory()
        url = bouncers["transaction"].url(db_url)
        engine = create_engine(url, connect_args={"prepare_threshold": None})
        load_engine = create_engine(url, connect_args={"prepare_threshold": None}, pool_size=3)
        stop = threading.Event()

        loaders = [threading.Thread(target=churn, args=(load_engine, stop)) for _ in range(3)]
        wakers = [
            Waker(psycopg_conninfo(url), f"orders.t{i}", threading.Event(), probe=engine)
            for i in range(4)
        ]
        try:
            for thread in loaders:
                thread.start()
            checks = [threading.Thread(target=w.check) for w in wakers]
            for thread in checks:
                thread.start()
            for thread in checks:
                thread.join()
            for w in wakers:  # a probe not sent (the pool busy, the server full) is no verdict
                for _ in range(10):
                    if w.listening is not None:
                        break
                    time.sleep(0.2)
                    w.check()
            assert [w.listening for w in wakers] == [False] * 4
        finally:
            for w in wakers:
                w.close()
            stop.set()
            for thread in loaders:
                thread.join()
            engine.dispose()
            load_engine.dispose()
        leaked += [
            seen for seen in _listening_in_pool(_pooled(bouncers["transaction"], db_url)) if seen[1]
        ]
    assert leaked == [], f"server connections left listening (pid, channels): {leaked}"


def test_a_waker_whose_probe_cannot_be_sent_keeps_no_listen_in_the_pool(
    db_url: str, bouncers: dict[str, PgBouncerServer]
) -> None:
    """No verdict (the probe's engine cannot reach the database) is no registration kept: the
    LISTEN is taken back, not left on a pooled server connection until the next probe; and a
    waker of a fleet (`helpers`) takes no lead, whose session lock would stay there too."""
    url = bouncers["transaction"].url(db_url)
    unreachable = create_engine(
        url.rsplit("/", 1)[0] + "/no_such_database", connect_args={"prepare_threshold": None}
    )
    stop = threading.Event()
    w = Waker(psycopg_conninfo(url), CHANNEL, stop, probe=unreachable, helpers=CHANNEL + "_h")
    try:
        assert w.check() is None
    finally:
        w.close()
        unreachable.dispose()
    assert [
        seen for seen in _listening_in_pool(_pooled(bouncers["transaction"], db_url)) if seen[1]
    ] == []


def _bury(conninfo: str, pid: int) -> None:
    """Put server connection `pid` under every other idle one of the pool: all held at once,
    `pid`'s given back first (PgBouncer hands out the one used last first)."""
    holders = [psycopg.connect(conninfo) for _ in range(POOL_SIZE)]
    try:
        pids = []
        for holder in holders:
            got = holder.execute("SELECT pg_backend_pid()").fetchone()
            assert got is not None
            pids.append(int(got[0]))
        assert pid in pids, (pid, pids)
        for i in sorted(range(POOL_SIZE), key=lambda i: pids[i] != pid):
            holders[i].rollback()
    finally:
        for holder in holders:
            holder.close()


def test_a_waker_whose_pooler_check_lost_its_race_takes_its_listen_back_from_deep_in_the_pool(
    db_url: str, bouncers: dict[str, PgBouncerServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pooler check before LISTEN can be outrun by other clients (it then finds nothing
    and LISTEN goes ahead): forced here. Once the probe's NOTIFY has not come back, the server
    connection that took the LISTEN is put under every other one of the pool, so that the
    waker's own UNLISTEN runs elsewhere. The waker still polls, and leaves nothing behind."""
    conninfo = _pooled(bouncers["transaction"], db_url)
    buried: list[int] = []
    take_back = Waker._take_back

    def late_take_back(self: Waker, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        assert self._pid is not None
        _bury(conninfo, self._pid)
        buried.append(self._pid)
        take_back(self, conn)

    monkeypatch.setattr(Waker, "_pinned", lambda self, conn: True)
    monkeypatch.setattr(Waker, "_take_back", late_take_back)
    url = bouncers["transaction"].url(db_url)
    engine = create_engine(url, connect_args={"prepare_threshold": None})
    waker = Waker(psycopg_conninfo(url), CHANNEL, threading.Event(), probe=engine)
    try:
        assert waker.check() is False
    finally:
        waker.close()
        engine.dispose()
    assert len(buried) == 1
    assert all(count == 0 for _, count in _listening_in_pool(conninfo))
