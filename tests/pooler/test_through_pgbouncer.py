"""The library behind PgBouncer: session and transaction pooling next to a direct connection.

Each test runs the real roles against a real PgBouncer (tests/pooler/bouncer.py) in front of
the tests' PostgreSQL; the schema is migrated on the direct URL, as docs/runbook.md says.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from helpers import make_service, rows, scalar, wait_until
from outbox_inbox import Service, Tenant, tenants
from outbox_inbox.archive import Archiver
from outbox_inbox.messages import Message
from outbox_inbox.queries import roles

from .bouncer import PgBouncerServer
from .conftest import POOL_SIZE

#: The ways in: (name, way to the database, listen_url given).
WAYS = [
    ("direct", "direct", False),
    ("session", "session", False),
    ("transaction", "transaction", False),
    ("transaction+listen_url", "transaction", True),
]
#: Where each flow test writes its measurements (for the report on the mode table).
REPORT = Path(os.environ.get("OUTBOX_INBOX_POOLER_REPORT", "/tmp/outbox-inbox-pooler.jsonl"))


def _settings(way: str, db_url: str, listen: bool) -> dict[str, Any]:
    """The settings docs/runbook.md gives for each way in."""
    settings: dict[str, Any] = {}
    if way == "transaction":
        settings["prepare_threshold"] = None  # PgBouncer 1.18 keeps no prepared statements
    if listen:
        settings["listen_url"] = db_url
    return settings


def _user_engine(url: str, way: str) -> Any:
    """The application's own engine, configured as docs/runbook.md shows for its pooler."""
    args = {"prepare_threshold": None} if way == "transaction" else {}
    return create_engine(url, connect_args=args)


@contextmanager
def _running(service: Service, **kwargs: Any) -> Iterator[Service]:
    service.start(**kwargs)
    try:
        yield service
    finally:
        service.close()


@pytest.mark.parametrize(("label", "way", "listen"), WAYS, ids=[w[0] for w in WAYS])
def test_commands_flow_exactly_once_with_no_failed_user_transaction(
    label: str,
    way: str,
    listen: bool,
    db_url: str,
    mq_url: str,
    pooled: Callable[[str, str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox_inbox")
    make_service("orders", db_url, mq_url).engine.dispose()  # migrated on the direct URL
    url = pooled(db_url, way)
    service = Service("orders", db_url=url, mq_url=mq_url, **_settings(way, db_url, listen))

    @service.on_command("thing.do")
    def do(message: Message, session: Session) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, :t)"),
            {"m": str(message.message_id), "t": message.type},
        )

    count = 40
    committed: dict[str, float] = {}
    failed: list[BaseException] = []
    user_engine = _user_engine(url, way)
    with _running(service):
        for n in range(count):
            try:
                # The application's own engine, and the service's (`Service.session()`).
                session_of = (lambda: Session(user_engine)) if n % 2 else service.session
                with session_of() as session, session.begin():
                    message_id = service.outbox.send(session, "orders", "thing.do", {"n": n})
                committed[str(message_id)] = time.time()
            except Exception as exc:
                failed.append(exc)
            time.sleep(0.1)  # one message at a time: latency, not throughput
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM effects") >= count - len(failed),
            timeout=30,
            what="every committed command handled",
        )
        wakeups = service.wakeups()
    user_engine.dispose()

    assert failed == []
    # No role met a database error on the way (they would retry it unseen by the counts):
    # the one warning allowed is the one that says wake-ups cannot arrive.
    troubles = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("outbox_inbox") and "wake-ups do not arrive" not in r.getMessage()
    ]
    assert troubles == []
    # Where they cannot arrive, one warning (not one per role) names the cause and the fix.
    told = [r.getMessage() for r in caplog.records if "wake-ups do not arrive" in r.getMessage()]
    if way == "transaction" and not listen:
        assert len(told) == 1
        assert "pool_mode=transaction" in told[0] and "listen_url" in told[0]
    else:
        assert told == []
    effects = rows(db_url, "SELECT message_id, extract(epoch FROM at) FROM effects")
    assert sorted(m for m, _ in effects) == sorted(committed)  # once each
    inbox = rows(db_url, "SELECT attempts, finished, last_error FROM outbox_inbox.inbox_messages")
    assert [tuple(r) for r in inbox] == [(1, 1, None)] * count  # no failed attempt
    latencies = sorted(float(at) - committed[m] for m, at in effects)
    assert latencies[-1] < 5, f"a message waited {latencies[-1]:.1f}s"
    # Wake-ups reach the roles except through a transaction pooler without listen_url.
    assert wakeups is (not (way == "transaction" and not listen))
    with REPORT.open("a") as report:
        report.write(
            json.dumps(
                {
                    "mode": label,
                    "effects_once": len(effects) == count,
                    "failed_user_transactions": len(failed),
                    "median": statistics.median(latencies),
                    "p90": latencies[int(0.9 * (len(latencies) - 1))],
                    "max": latencies[-1],
                    "wakeups": wakeups,
                }
            )
            + "\n"
        )


@pytest.mark.parametrize(("label", "way", "listen"), WAYS, ids=[w[0] for w in WAYS])
def test_a_hung_handler_is_cut_off_after_the_lease_and_another_worker_handles_it(
    label: str, way: str, listen: bool, db_url: str, mq_url: str, pooled: Callable[[str, str], str]
) -> None:
    make_service("orders", db_url, mq_url).engine.dispose()
    service = Service(
        "orders",
        db_url=pooled(db_url, way),
        mq_url=mq_url,
        lease=2,
        worker_poll_interval=0.2,
        relay_poll_interval=0.2,
        **_settings(way, db_url, listen),
    )
    runs: list[str] = []
    release = threading.Event()

    @service.on_command("thing.do")
    def do(message: Message, session: Session) -> None:
        runs.append("run")
        info = "ok"
        if len(runs) == 1:
            session.execute(text("SELECT 1"))  # the transaction holds its row lock
            release.wait(20)  # hangs, idle in its transaction, well past the lease
            info = "hung"
        session.execute(
            text("INSERT INTO effects (message_id, type, info) VALUES (:m, :t, :i)"),
            {"m": str(message.message_id), "t": message.type, "i": info},
        )

    with _running(service, workers=2):
        with Session(service.engine) as session, session.begin():
            service.outbox.send(session, "orders", "thing.do", {})
        started = time.monotonic()
        # The other worker can only take the row once the server ended the hung transaction.
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM effects") == 1,
            timeout=12,
            what="the message handled by the other worker while the first still hangs",
        )
        assert time.monotonic() - started < 12
        assert not release.is_set()
        release.set()
        time.sleep(1)  # the hung handler returns and tries to commit
    assert rows(db_url, "SELECT info FROM effects") == [("ok",)]
    assert len(runs) == 2


@pytest.mark.parametrize("way", ["direct", "session", "transaction"])
def test_three_archive_runs_back_to_back_each_take_the_lock_and_leave_none(
    way: str, db_url: str, mq_url: str, pooled: Callable[[str, str], str], tmp_path: Path
) -> None:
    make_service("orders", db_url, mq_url).engine.dispose()
    service = Service("orders", db_url=pooled(db_url, way), **_settings(way, db_url, False))
    with _traffic(pooled(db_url, way)):
        _archive_three_times(service, tmp_path, db_url)
    service.close()


@contextmanager
def _traffic(url: str, clients: int = 3) -> Iterator[None]:
    """Other clients of the pool, busy with short transactions (a service's roles would be)."""
    stop = threading.Event()

    def busy() -> None:
        conninfo = url.replace("+psycopg", "")
        with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_sleep(0.003)")

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def _archive_three_times(service: Service, tmp_path: Path, db_url: str) -> None:
    for run in range(3):
        with Session(service.engine) as session, session.begin():
            for n in range(3):
                service.outbox.send(session, "billing", "invoice.create", {"run": run, "n": n})
        with service.engine.begin() as conn:
            conn.execute(text("UPDATE outbox_inbox.outbox_messages SET published_at = now()"))
        result = Archiver(
            service.engine, service.tables, "orders", tmp_path, older_than=timedelta(0)
        ).run()
        assert result.rows["outbox"] == 3
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == 0
    assert len(list(tmp_path.rglob("*.parquet"))) >= 3
    # No lock outlives its run on any server connection of the pool.
    held = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    assert scalar(db_url, held) == 0


def test_a_fresh_client_of_the_transaction_pool_sees_the_server_defaults(
    db_url: str, mq_url: str, bouncers: dict[str, PgBouncerServer], tmp_path: Path
) -> None:
    """After the roles, a probe that fails and an archive ran through the pool, every server
    connection of the pool looks to the next client as a new session would."""
    make_service("orders", db_url, mq_url).engine.dispose()
    url = bouncers["transaction"].url(db_url)
    service = Service(
        "orders", db_url=url, mq_url=mq_url, prepare_threshold=None, worker_poll_interval=0.1
    )

    @service.on_command("thing.do")
    def do(message: Message, session: Session) -> None:
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'x')"),
            {"m": str(message.message_id)},
        )

    with _running(service, workers=2):
        for _ in range(10):
            with Session(service.engine) as session, session.begin():
                service.outbox.send(session, "orders", "thing.do", {})
        wait_until(lambda: scalar(db_url, "SELECT count(*) FROM effects") == 10, timeout=20)
        assert service.wakeups() is False
    Archiver(service.engine, service.tables, "orders", tmp_path, older_than=timedelta(0)).run()

    check = (
        "SELECT current_setting('idle_in_transaction_session_timeout'),"
        " current_setting('tcp_keepalives_idle'),"
        " (SELECT count(*) FROM pg_listening_channels()),"
        " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),"
        " pg_backend_pid()"
    )
    with psycopg.connect(db_url.replace("+psycopg", "")) as direct:
        fresh = direct.execute(check).fetchone()
    assert fresh is not None
    conninfo = url.replace("+psycopg", "")
    clients = [psycopg.connect(conninfo) for _ in range(POOL_SIZE)]
    try:
        # Each client in a transaction holds a server connection of its own: all of the pool.
        seen = [client.execute(check).fetchone() for client in clients]
    finally:
        for client in clients:
            client.close()
    assert len({s[4] for s in seen if s}) == POOL_SIZE
    for values in seen:
        assert values is not None
        assert values[:4] == (fresh[0], fresh[1], 0, 0), values


#: A worker process that claims every due row, says so, and waits to be killed.
_CLAIMER = """
import sys, time
from datetime import timedelta
from outbox_inbox import Service
from outbox_inbox.queries import roles
settings = {} if sys.argv[3] == "-" else {"listen_url": sys.argv[3]}
service = Service("orders", db_url=sys.argv[1], prepare_threshold=None, **settings)
worker = service.worker()
conn = worker.connect()
with conn.begin():
    rows = roles.claim_inbox(conn, service.tables, worker.claimant, 50, timedelta(seconds=60))
print(len(rows), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("label", "way", "listen"), WAYS, ids=[w[0] for w in WAYS])
def test_a_killed_workers_rows_are_free_at_the_next_claim_where_a_session_holds_its_liveness(
    label: str,
    way: str,
    listen: bool,
    db_url: str,
    mq_url: str,
    pooled: Callable[[str, str], str],
) -> None:
    make_service("orders", db_url, mq_url).engine.dispose()
    url = pooled(db_url, way)
    service = Service("orders", db_url=url, mq_url=mq_url, **_settings(way, db_url, listen))
    service.on_command("thing.do")(lambda message, session: None)
    with _running(service, workers=0):  # relay and receiver store the rows
        with Session(service.engine) as session, session.begin():
            for n in range(5):
                service.outbox.send(session, "orders", "thing.do", {"n": n})
        wait_until(
            lambda: scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 5,
            timeout=20,
            what="five rows stored",
        )
    claimer = subprocess.Popen(
        [sys.executable, "-c", _CLAIMER, url, mq_url, db_url if listen else "-"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert claimer.stdout is not None
        assert claimer.stdout.readline().strip() == "5"
        claimer.send_signal(signal.SIGKILL)
        claimer.wait(10)
    finally:
        if claimer.poll() is None:
            claimer.kill()
    time.sleep(0.5)  # the server (through the pooler) sees the connections close
    other = Service("orders", db_url=url, **_settings(way, db_url, listen))
    worker = other.worker()
    conn = worker.connect()
    try:
        with conn.begin():
            lease = timedelta(seconds=60)
            free = len(roles.claim_inbox(conn, other.tables, worker.claimant, 50, lease))
    finally:
        conn.close()
        worker.close_liveness()
        other.close()
    # The lease is 60 s: only a liveness lock that died with the worker frees them now.
    # Behind a transaction pooler without listen_url no session holds one: the lease does.
    assert free == (0 if (way == "transaction" and not listen) else 5)


@pytest.mark.parametrize(
    ("way", "shown"),
    [
        ("direct", "wake-ups: notify (LISTEN through db_url)"),
        ("session", "wake-ups: notify (LISTEN through db_url)"),
        ("transaction", "wake-ups: polling (NOTIFY does not come back through db_url"),
    ],
)
def test_status_shows_whether_wake_ups_arrive_through_the_pooler(
    way: str, shown: str, db_url: str, mq_url: str, pooled: Callable[[str, str], str]
) -> None:
    make_service("orders", db_url, mq_url).engine.dispose()
    command = Path(sys.executable).parent / "outbox-inbox"
    result = subprocess.run(
        [str(command), "status", "--service", "orders", "--db-url", pooled(db_url, way)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUTBOX_INBOX_MQ_URL": ""},
    )
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout


def test_the_default_engine_behind_a_transaction_pooler_never_prepares_for_concurrent_users(
    db_url: str, mq_url: str, pooled: Callable[[str, str], str]
) -> None:
    make_service("orders", db_url, mq_url).engine.dispose()  # migrated on the direct URL
    # The library's defaults, nothing said about the pooler.
    service = Service("orders", db_url=pooled(db_url, "transaction"), mq_url=mq_url)
    direct = Service("orders", db_url=db_url, mq_url=mq_url)
    failures: list[BaseException] = []
    users, each = 6, 60

    def user() -> None:
        for n in range(each):
            try:
                # The user's own transaction on Service.session(): the same statements again
                # and again, which psycopg would prepare after 5 executions.
                with service.session() as session, session.begin():
                    service.outbox.send(session, "orders", "thing.do", {"n": n})
                    session.execute(
                        text("SELECT count(*) FROM effects WHERE type = :t"), {"t": "x"}
                    )
            except Exception as exc:
                failures.append(exc)

    try:
        threads = [threading.Thread(target=user) for _ in range(users)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [str(f).splitlines()[0] for f in failures[:3]] == []
        assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.outbox_messages") == users * each
        # Found per connection: through the pooler nothing is prepared; directly, after 5.
        with service.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None
        with direct.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == 5
    finally:
        service.close()
        direct.close()


@pytest.mark.parametrize(("label", "way", "listen"), WAYS, ids=[w[0] for w in WAYS])
def test_the_tenants_fleet_drains_through_each_way_in_and_prepares_only_on_its_own_session(
    label: str,
    way: str,
    listen: bool,
    db_url: str,
    mq_url: str,
    pooled: Callable[[str, str], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = {"a": Tenant(schema="t_a"), "b": Tenant(schema="t_b")}
    direct = Service("orders", db_url=db_url, mq_url=mq_url, tenants=registry)
    direct.migrate()  # on the direct URL, as docs/runbook.md says
    for tenant in registry:
        direct.tenant(tenant).migrate()
    direct.close()
    listened: list[Any] = []  # the hub's LISTEN connections: its sweep's session when there
    real = tenants.Hub._listen
    monkeypatch.setattr(
        tenants.Hub, "_listen", lambda hub: listened.append(real(hub)) or listened[-1]
    )
    url = pooled(db_url, way)
    service = Service(
        "orders", db_url=url, mq_url=mq_url, tenants=registry, **_settings(way, db_url, listen)
    )
    service.declare_topology()
    unsent = "SELECT count(*) FROM {}.outbox_messages WHERE published_at IS NULL"
    with _running(service, receiver=False, workers=0):
        for tenant in registry:
            t = service.tenant(tenant)
            with t.engine.begin() as conn:  # sent through the pooler; its wake-up too
                t.outbox.send(conn, "orders", "thing.do", {"tenant": tenant})
        for tenant in registry:
            sql = unsent.format(registry[tenant].schema)
            wait_until(lambda sql=sql: scalar(db_url, sql) == 0, timeout=20, what=f"{tenant} sent")
    # A transaction pooler keeps no session: the hub neither listens nor prepares through it.
    assert listened and all((c is None) == (way == "transaction" and not listen) for c in listened)
    if way == "transaction":  # every server connection of its pool, held at once: none prepared
        held = [psycopg.connect(url.replace("+psycopg", "")) for _ in range(POOL_SIZE)]
        try:
            prepared = [
                c.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() for c in held
            ]
            pids = {c.execute("SELECT pg_backend_pid()").fetchone() for c in held}
        finally:
            for c in held:
                c.close()
        assert len(pids) == POOL_SIZE and prepared == [(0,)] * POOL_SIZE
