"""The tenants fleet (outbox_inbox.tenants): the relays and workers of a service with tenants
drain every tenant's outbox and inbox, in the tenant's database, sharing them by lease."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from helpers import FAST, received_row, rows, scalar, wait_until
from outbox_inbox import Message, Retry, Service, Tenant, tenants
from outbox_inbox.queries import roles

#: Whether the receiver stores a tenant's delivery in that tenant's inbox (issue 38's
#: receiving side); the end-to-end test needs it, the relay and worker tests do not.

EFFECTS = (
    "CREATE TABLE IF NOT EXISTS public.effects (message_id text PRIMARY KEY, tenant text NOT NULL,"
    " db text NOT NULL DEFAULT current_database())"
)


def _handler(message: Message, session: Any) -> None:
    session.execute(
        text("INSERT INTO public.effects (message_id, tenant) VALUES (:m, :t)"),
        {"m": str(message.message_id), "t": message.tenant},
    )


def _service(db_url: str, mq_url: str, registry: Any, **settings: Any) -> Service:
    settings = {**FAST, **settings}
    svc = Service("billing", db_url=db_url, mq_url=mq_url, tenants=registry, **settings)
    svc.migrate()
    svc.on_command("invoice.create")(_handler)
    return svc


def _prepare(svc: Service, tenant: str) -> None:
    """Migrate the tenant's schema and give its database the effects table."""
    t = svc.tenant(tenant)
    t.migrate()
    with t.engine.begin() as conn:
        conn.execute(text(EFFECTS))


def _tenants(
    mode: str, db_url: str, db_url_factory: Callable[[], str], names: list[str]
) -> dict[str, Tenant]:
    if mode == "schema":
        return {n: Tenant(schema=f"t_{n}") for n in names}
    return {n: Tenant(db_url=db_url_factory(), schema="outbox_inbox") for n in names}


def _publish(svc: Service, tenant: str, count: int) -> None:
    t = svc.tenant(tenant)
    with t.session() as session, session.begin():
        for n in range(count):
            t.outbox.send(session, "billing", "invoice.create", {"n": n})


def _count(svc: Service, tenant: str, sql: str) -> int:
    t = svc.tenant(tenant)
    with t.engine.connect() as conn:
        return int(conn.execute(text(sql.format(schema=t.settings.schema))).scalar() or 0)


def _unsent(svc: Service, tenant: str) -> int:
    sql = "SELECT count(*) FROM {schema}.outbox_messages WHERE published_at IS NULL"
    return _count(svc, tenant, sql)


def _processed(svc: Service, tenant: str) -> int:
    sql = "SELECT count(*) FROM {schema}.inbox_messages WHERE status = 'processed'"
    return _count(svc, tenant, sql)


def _store(svc: Service, tenant: str, count: int) -> None:
    """Store `count` received commands in the tenant's inbox, as a receiver would."""
    t = svc.tenant(tenant)
    with t.engine.begin() as conn:
        roles.insert_inbox(conn, t.tables, [received_row(tenant=tenant) for _ in range(count)])


@contextmanager
def _started(svc: Service, **roles_: Any) -> Iterator[Service]:
    svc.start(**roles_)
    try:
        yield svc
    finally:
        svc.close()


@pytest.mark.parametrize("mode", ["schema", "database"])
def test_the_relay_fleet_sends_each_tenants_outbox_once(
    mode: str, db_url: str, db_url_factory: Callable[[], str], mq_url: str
) -> None:
    registry = _tenants(mode, db_url, db_url_factory, ["a", "b"])
    svc = _service(db_url, mq_url, registry)
    svc.declare_topology()
    for tenant in registry:
        _prepare(svc, tenant)
        _publish(svc, tenant, 30)
    with _started(svc, receiver=False, workers=0):
        for tenant in registry:
            wait_until(lambda t=tenant: _unsent(svc, t) == 0, what=f"tenant {tenant} sent")
        wait_until(lambda: svc.broker.queue_depth("billing.inbox") == 60, what="60 queued")
    assert svc.broker.queue_depth("billing.inbox") == 60


def test_a_tenants_commit_wakes_the_relay_fleet_without_the_sweep(
    db_url: str, mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenants.Hub, "_sweep", lambda self, batch: None)
    registry = {"a": Tenant(schema="t_a")}
    svc = _service(db_url, mq_url, registry)
    svc.declare_topology()
    _prepare(svc, "a")
    with _started(svc, receiver=False, workers=0):
        time.sleep(1.0)  # past the first read of the registry
        for round_ in range(3):
            _publish(svc, "a", 1)
            wait_until(lambda: _unsent(svc, "a") == 0, timeout=10, what=f"round {round_}")
        a = svc.tenant("a")
        with a.engine.begin() as conn:  # a Connection's write in the service's database wakes too
            a.outbox.send(conn, "billing", "invoice.create", {"n": "connection"})
        wait_until(lambda: _unsent(svc, "a") == 0, timeout=10, what="the Connection's write")
    assert svc.broker.queue_depth("billing.inbox") == 4


def test_a_tenants_retry_is_handled_when_it_is_due_without_the_sweep(
    db_url: str, mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenants.Hub, "_sweep", lambda self, batch: None)
    svc = _service(db_url, mq_url, {"a": Tenant(schema="t_flaky")})
    tries: list[float] = []

    @svc.on_command("invoice.flaky")
    def flaky(message: Message, session: Any) -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise Retry(delay=1.0)

    _prepare(svc, "a")
    with _started(svc, relay=False, receiver=False, workers=1):
        time.sleep(1.0)  # past the first read of the registry
        t = svc.tenant("a")
        with t.engine.begin() as conn:
            roles.insert_inbox(conn, t.tables, [received_row(routing_key="billing.invoice.flaky")])
        tenants.wake(svc.engine, svc.settings.schema, "worker", ["a"])
        wait_until(lambda: _processed(svc, "a") == 1, timeout=10, what="the retry handled")
    assert len(tries) == 2 and 1.0 <= tries[1] - tries[0] < 3.0, tries


def test_the_sweep_probes_on_the_listen_session_and_keeps_the_wake_ups_sent_meanwhile(
    db_url: str, mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each probe finds nothing and holds the LISTEN session 0.7 s of every second: a commit's
    # wake-up that arrived during one and were dropped would leave its row unsent for good.
    slow = "SELECT 'relay:none' WHERE pg_sleep(0.7)::text = 'never'"
    monkeypatch.setattr(tenants.Hub, "_probe", lambda self, role, tenant, schema: slow)
    listeners: set[int] = set()
    real = tenants.Hub._sweep

    def sweep(self: tenants.Hub, batch: list[str]) -> None:
        if self._conn is not None:
            listeners.add(self._conn.info.backend_pid)
        real(self, batch)

    monkeypatch.setattr(tenants.Hub, "_sweep", sweep)
    svc = _service(db_url, mq_url, {"a": Tenant(schema="t_slow")})
    svc.declare_topology()
    _prepare(svc, "a")
    probing = "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query = :q"
    seen: set[int] = set()

    def probed() -> bool:
        now = {int(pid) for (pid,) in rows(db_url, probing, q=slow)}
        seen.update(now)
        return bool(now)

    with _started(svc, receiver=False, workers=0):
        time.sleep(1.0)  # past the first read of the registry
        for round_ in range(6):
            time.sleep(0.15 * round_)  # at another moment of the sweep's second each time
            _publish(svc, "a", 1)
            wait_until(lambda: _unsent(svc, "a") == 0, timeout=4, what=f"round {round_}")
            wait_until(probed, what="a probe running")
    assert len(listeners) == 1 and seen == listeners, (seen, listeners)
    assert svc.broker.queue_depth("billing.inbox") == 6


def test_the_sweeps_prepared_statements_stay_one_per_group_while_the_registry_changes(
    db_url: str, mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenants, "REFRESH", 0.2)
    monkeypatch.setattr(tenants, "SWEEP", 2)
    every = {f"r{n}": Tenant(schema=f"t_r{n}") for n in range(7)}
    reads = [0]

    def registry() -> dict[str, Tenant]:  # one tenant left out in turn: the groups shift
        reads[0] += 1
        return {k: v for n, (k, v) in enumerate(every.items()) if n != reads[0] % len(every)}

    prepared: list[int] = []
    real = tenants.Hub._sweep

    def sweep(self: tenants.Hub, batch: list[str]) -> None:
        real(self, batch)
        if self._conn is not None:
            found = self._conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            prepared.append(int(found[0]) if found else -1)

    monkeypatch.setattr(tenants.Hub, "_sweep", sweep)
    svc = _service(db_url, mq_url, registry)
    for tenant in every:
        t = Service("billing", db_url=db_url, schema=every[tenant].schema, **FAST)
        t.migrate()
        t.close()
    with _started(svc, relay=False, receiver=False, workers=1):
        wait_until(lambda: len(prepared) >= 12, timeout=30, what="12 sweeps")
    # 6 tenants at a time in groups of 2: 3 groups, and a dozen group texts over the run.
    assert 0 < max(prepared) <= 6 // 2 + 2, prepared


@pytest.mark.parametrize("mode", ["schema", "database"])
def test_the_worker_fleet_handles_each_tenants_inbox_once_in_its_database(
    mode: str, db_url: str, db_url_factory: Callable[[], str], mq_url: str
) -> None:
    registry = _tenants(mode, db_url, db_url_factory, ["a", "b", "c"])
    svc = _service(db_url, mq_url, registry, worker_batch_size=5)
    for tenant in registry:
        _prepare(svc, tenant)
        _store(svc, tenant, 20)
    with _started(svc, relay=False, receiver=False, workers=2):
        for tenant in registry:
            wait_until(lambda t=tenant: _processed(svc, t) == 20, what=f"tenant {tenant}")
    for tenant in registry:
        sql = "SELECT count(*), count(DISTINCT message_id), min(tenant), max(tenant) FROM effects"
        with svc.tenant(tenant).engine.connect() as conn:
            found = tuple(conn.execute(text(sql)).one())
        expected = (20, 20, tenant, tenant) if mode == "database" else (60, 60, "a", "c")
        assert found == expected


def test_one_fleet_worker_drains_the_schemas_of_a_database_on_one_connection(
    db_url: str, mq_url: str
) -> None:
    registry = {n: Tenant(schema=f"t_{n}") for n in "abcde"}
    svc = _service(db_url, mq_url, registry)
    for tenant in registry:
        _prepare(svc, tenant)
        _store(svc, tenant, 3)
    liveness = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
        f" AND classid = {roles.WORKER_LOCK} AND database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())"
    )
    with _started(svc, relay=False, receiver=False, workers=1):
        for tenant in registry:
            wait_until(lambda t=tenant: _processed(svc, t) == 3, what=f"tenant {tenant}")
        held = scalar(db_url, liveness)  # within the 5 s a worker connection outlives its batch
    # The service's own worker, and the fleet's worker thread once for the five schemas.
    assert held == 2


def test_a_tenants_lease_is_kept_while_it_has_work_and_released_once_idle(
    db_url: str, mq_url: str
) -> None:
    svc = _service(db_url, mq_url, {"kept": Tenant(schema="t_kept")})
    _prepare(svc, "kept")
    lease = "SELECT locked_until FROM outbox_inbox.tenant_leases WHERE tenant = 'kept'"
    with _started(svc, relay=False, receiver=False, workers=1):
        for n in (1, 2):
            _store(svc, "kept", 2)
            tenants.wake(svc.engine, "outbox_inbox", tenants.WORKER, ["kept"])
            wait_until(lambda n=n: _processed(svc, "kept") == 2 * n, what=f"drain {n}")
            if n == 1:
                first = scalar(db_url, lease)
        assert first is not None, "the lease was given up after the drain"
        assert scalar(db_url, lease) == first, "a young lease was taken again"
        wait_until(lambda: scalar(db_url, lease) is None, timeout=20, what="released once idle")


def test_a_lease_kept_by_one_fleet_thread_does_not_hold_up_the_others_of_its_process(
    db_url: str, mq_url: str
) -> None:
    svc = _service(db_url, mq_url, {"again": Tenant(schema="t_again")})  # lease: 60 s
    _prepare(svc, "again")
    with _started(svc, relay=False, receiver=False, workers=3):
        for n in range(1, 9):  # woken again and again: taken by whichever thread is free
            _store(svc, "again", 1)
            tenants.wake(svc.engine, "outbox_inbox", tenants.WORKER, ["again"])
            wait_until(lambda n=n: _processed(svc, "again") == n, timeout=5, what=f"round {n}")


@pytest.mark.parametrize("mode", ["schema", "database"])
def test_sent_in_a_tenants_session_handled_once_in_that_tenants_inbox(
    mode: str,
    db_url: str,
    db_url_factory: Callable[[], str],
    mq_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No sweep: the tenant's commit wakes the relays, the receiver's the workers.
    monkeypatch.setattr(tenants.Hub, "_sweep", lambda self, batch: None)
    registry = _tenants(mode, db_url, db_url_factory, ["a", "b"])
    svc = _service(db_url, mq_url, registry)
    for tenant in registry:
        _prepare(svc, tenant)
    with _started(svc):
        for tenant in registry:
            _publish(svc, tenant, 10)
        for tenant in registry:
            wait_until(lambda t=tenant: _processed(svc, t) == 10, what=f"tenant {tenant}")
    assert scalar(db_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 0
    for tenant in registry:
        assert _count(svc, tenant, "SELECT count(*) FROM {schema}.inbox_messages") == 10


def test_a_busy_tenant_does_not_starve_another(db_url: str, mq_url: str) -> None:
    registry = {"busy": Tenant(schema="t_busy"), "calm": Tenant(schema="t_calm")}
    svc = _service(db_url, mq_url, registry, worker_batch_size=5)
    for tenant in registry:
        _prepare(svc, tenant)
    _store(svc, "busy", 1000)
    with _started(svc, relay=False, receiver=False, workers=1):
        wait_until(lambda: _processed(svc, "busy") > 0, what="the busy tenant served")
        _store(svc, "calm", 5)
        tenants.wake(svc.engine, svc.settings.schema, "worker", ["calm"])  # as a receiver does
        wait_until(lambda: _processed(svc, "calm") == 5, timeout=30, what="the calm tenant")
        busy = _processed(svc, "busy")
    print(f"the calm tenant was served with {busy} of the busy tenant's 1000 handled")
    assert busy < 500  # woken, the calm tenant waits a few quanta of the busy one at most


def test_a_tenant_added_while_running_is_drained_without_a_restart(
    db_url: str, mq_url: str
) -> None:
    registry = {"a": Tenant(schema="t_a")}
    svc = _service(db_url, mq_url, lambda: dict(registry))
    _prepare(svc, "a")
    with _started(svc, relay=False, receiver=False, workers=1):
        _store(svc, "a", 3)
        wait_until(lambda: _processed(svc, "a") == 3, what="tenant a")
        registry["late"] = Tenant(schema="t_late")
        _prepare(svc, "late")
        _store(svc, "late", 4)
        wait_until(lambda: _processed(svc, "late") == 4, timeout=30, what="the new tenant")


CHILD = """
import os, sys, time
from outbox_inbox import Service, Tenant
from sqlalchemy import Engine, event, text

def handle(message, session):
    if message.payload.get("hang"):
        open(os.environ["MARKER"], "w").close()
        time.sleep(600)
    session.execute(text("INSERT INTO public.effects (message_id, tenant) VALUES (:m, :t)"),
                    {"m": str(message.message_id), "t": message.tenant})

registry = {n: Tenant(schema="t_" + n) for n in os.environ["TENANTS"].split(",")}
svc = Service("billing", db_url=os.environ["DB_URL"], mq_url=os.environ["MQ_URL"],
              tenants=registry, processes=1, lease=float(os.environ["LEASE"]),
              worker_poll_interval=0.1, reconnect_initial=0.1, reconnect_max=1.0)
svc.on_command("invoice.create")(handle)
svc.run_worker()
"""


def test_a_killed_workers_tenants_are_drained_by_another_within_the_lease(
    db_url: str, mq_url: str, tmp_path: Path
) -> None:
    lease = 4.0
    names = ["a", "b", "c"]
    registry = {n: Tenant(schema=f"t_{n}") for n in names}
    svc = _service(db_url, mq_url, registry, lease=lease)
    for n in names:
        _prepare(svc, n)
    t = svc.tenant("a")
    with t.engine.begin() as conn:  # the first row of a hangs its handler
        hang = received_row(tenant="a", payload={"hang": True})
        roles.insert_inbox(conn, t.tables, [hang])
    for n in names:
        _store(svc, n, 5)
    marker = tmp_path / "hanging"
    env = {
        **os.environ,
        "MARKER": str(marker),
        "TENANTS": ",".join(names),
        "DB_URL": db_url,
        "MQ_URL": mq_url,
        "LEASE": str(lease),
    }
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD)], env=env)
    try:
        wait_until(marker.exists, timeout=60, what="the child's handler hanging in tenant a")
        held = scalar(db_url, "SELECT count(*) FROM outbox_inbox.tenant_leases")
        assert held >= 1
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        killed = time.monotonic()
        with _started(svc, relay=False, receiver=False, workers=1):
            wait_until(
                lambda: all(_processed(svc, n) == (6 if n == "a" else 5) for n in names),
                timeout=lease + 30,
                what="every tenant drained after the kill",
            )
            took = time.monotonic() - killed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    print(f"tenants drained {took:.1f} s after the SIGKILL (lease {lease} s)")
    with t.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.effects")).scalar() == 16


def test_a_tenant_database_down_is_its_own_outage_warned_once_and_tried_at_its_backoffs_pace(
    db_url: str,
    db_url_factory: Callable[[], str],
    mq_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _tenants("database", db_url, db_url_factory, ["up", "down"])
    svc = _service(db_url, mq_url, registry, reconnect_max=4.0)
    svc.declare_topology()
    for tenant in registry:
        _prepare(svc, tenant)
    _publish(svc, "down", 5)
    down = svc.tenant("down").engine.url.database
    svc.tenant("down").engine.dispose()
    tries: list[float] = []  # when a connection to the down database was opened or tried

    def connecting(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        if cparams.get("dbname") == down:
            tries.append(time.monotonic())

    def allow(value: bool) -> None:
        with svc.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(text(f'ALTER DATABASE "{down}" ALLOW_CONNECTIONS {value}'))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                {"d": down},
            )

    allow(False)
    caplog.set_level(logging.INFO, logger="outbox_inbox.tenants")
    event.listen(Engine, "do_connect", connecting)
    try:
        with _started(svc, receiver=False, workers=0):
            started = time.monotonic()
            for round_ in range(3):
                _publish(svc, "up", 10)
                wait_until(lambda: _unsent(svc, "up") == 0, what=f"round {round_} of up")
                time.sleep(1.0)
            warned = [  # the fleet's (the maintenance pass warns once of its own)
                r
                for r in caplog.records
                if r.name == "outbox_inbox.tenants" and r.levelno == logging.WARNING
            ]
            assert len(warned) == 1, [r.message for r in warned]
            time.sleep(max(0.0, started + 8 - time.monotonic()))
            # From 4 s on, the backoff waits 2 to 4 s between tries: not a try a second.
            late = [t - started for t in tries if t > started + 4]
            assert len(late) <= 2, f"tried {len(late)} times in 4 s of the outage: {late}"
            allow(True)
            wait_until(lambda: _unsent(svc, "down") == 0, timeout=30, what="down, back")
        assert svc.broker.queue_depth("billing.inbox") == 35
    finally:
        event.remove(Engine, "do_connect", connecting)
        allow(True)


def _connections(db_url: str, database: str | None = None) -> int:
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = coalesce(:d, current_database())"
        " AND pid <> pg_backend_pid()"
    )
    return int(scalar(db_url, sql, d=database))


def _held(db_url: str, mq_url: str, count: int) -> int:
    """The most connections the fleet holds to its database with `count` idle schema tenants."""
    registry = {f"i{n}": Tenant(schema=f"idle_{n}") for n in range(count)}
    svc = _service(db_url, mq_url, registry)
    for tenant in registry:
        svc.tenant(tenant).migrate()
    svc.engine.dispose()
    held = 0
    with _started(svc, receiver=False, workers=1):
        for _ in range(15):  # 4.5 s: the sweep probes 50 tenants in 2.5 s
            time.sleep(0.3)
            held = max(held, _connections(db_url))
    return held


def test_idle_tenants_hold_no_connection(db_url_factory: Callable[[], str], mq_url: str) -> None:
    one, fifty = _held(db_url_factory(), mq_url, 1), _held(db_url_factory(), mq_url, 50)
    print(f"connections held: {one} with 1 idle tenant, {fifty} with 50")
    assert fifty <= one + 1


def test_an_idle_tenant_database_holds_no_connection_after_its_work(
    db_url: str, db_url_factory: Callable[[], str], mq_url: str
) -> None:
    registry = _tenants("database", db_url, db_url_factory, ["a", "b", "c"])
    svc = _service(db_url, mq_url, registry)
    for tenant in registry:
        _prepare(svc, tenant)
        _store(svc, tenant, 2)
    names = [svc.tenant(t).engine.url.database for t in registry]
    with _started(svc, relay=False, receiver=False, workers=1):
        for tenant in registry:
            wait_until(lambda t=tenant: _processed(svc, t) == 2, what=f"tenant {tenant}")
        for tenant in registry:
            svc.tenant(tenant).engine.dispose()  # the test's own connections
        wait_until(
            lambda: sum(_connections(db_url, n) for n in names) == 0,
            timeout=30,
            what="no connection to the idle tenants' databases",
        )
