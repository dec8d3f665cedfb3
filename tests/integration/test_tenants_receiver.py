"""A service with tenants: the receiver stores each delivery in its tenant's inbox once; the
migrations and the partitions' maintenance run on every tenant (docs/tenants.md)."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from helpers import FAST, publish_raw, running, scalar, wait_until
from outbox_inbox import RetryPolicy, Service, Tenant, partitions
from outbox_inbox import receiver as receiver_module
from outbox_inbox import service as service_module
from outbox_inbox.broker import Consumer, Delivery
from outbox_inbox.cli.db import db
from outbox_inbox.dead_letters import QUEUE, DeadLetters, Filters
from outbox_inbox.errors import DatabaseUnavailable
from outbox_inbox.queries import roles
from outbox_inbox.tables import build_tables

INVOICE = "billing.invoice.create"


@pytest.fixture(autouse=True)
def _quick_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # The receiver reads the registry anew, and tries an unreachable tenant again, at once.
    monkeypatch.setattr(receiver_module, "TENANTS_REFRESH", 0.05)


def _billing(
    db_url_factory: Callable[[], str], mq_url: str, **settings: Any
) -> tuple[Service, dict[str, Tenant], dict[str, str]]:
    """billing on its own database, tenants acme and beta as schemas of it, and gamma in a
    database of its own; the registry is a callable over a dict the test may change. Returns
    the service, the registry and where each inbox table is: tenant ("" for the service's own)
    -> "db_url|schema"."""
    own, other = db_url_factory(), db_url_factory()
    registry = {"acme": Tenant(schema="acme"), "beta": Tenant(schema="beta")}
    registry["gamma"] = Tenant(db_url=other)
    svc = Service(
        "billing", db_url=own, mq_url=mq_url, tenants=lambda: dict(registry), **FAST, **settings
    )
    svc.migrate()
    for tenant in registry:
        svc.tenant(tenant).migrate()
    svc.declare_topology()
    where = {"": f"{own}|outbox_inbox", "acme": f"{own}|acme", "beta": f"{own}|beta"}
    where["gamma"] = f"{other}|outbox_inbox"
    return svc, registry, where


def _inbox(place: str) -> list[tuple[str, str]]:
    """(message_id, tenant) of every row of the inbox at `place`, in id order."""
    url, schema = place.split("|")
    got = scalar(
        url,
        f"SELECT coalesce(json_agg(json_build_array(message_id::text, tenant) ORDER BY id), '[]')"
        f" FROM {schema}.inbox_messages",
    )
    return [tuple(pair) for pair in got]


def _send_raw(mq_url: str, tenant: str | None, message_id: str | None = None) -> str:
    message_id = message_id or str(uuid.uuid4())
    headers = {"x-tenant": tenant} if tenant else {}
    publish_raw(
        mq_url,
        "commands",
        INVOICE,
        b'{"n": 1}',
        message_id=message_id,
        type=INVOICE,
        content_type="application/json",
        headers=headers,
    )
    return message_id


def test_each_tenants_messages_are_stored_once_in_its_inbox_and_nowhere_else(
    db_url_factory: Callable[[], str], mq_url: str
) -> None:
    # Each tenant's relay below keeps a publishing connection checked out of the shared pool.
    svc, _registry, where = _billing(db_url_factory, mq_url, publisher_connections=3)
    sent: dict[str, list[str]] = {t: [] for t in where}
    for tenant in ("acme", "beta", "gamma"):  # through the tenant's outbox and relay
        copy = svc.tenant(tenant)
        with copy.session() as session, session.begin():
            for n in range(2):
                sent[tenant].append(str(copy.outbox.send(session, "billing", "invoice.create", n)))
        assert copy.relay().relay_once() == 2
    sent["beta"].append(_send_raw(mq_url, "beta"))  # any AMQP client naming the tenant
    sent[""].append(_send_raw(mq_url, None))  # no tenant: the service's own inbox, as ever
    receiver = svc.receiver()
    with running(receiver):
        wait_until(lambda: receiver.stored == 8, what="8 messages stored")
    for tenant, place in where.items():
        assert _inbox(place) == [(m, tenant) for m in sent[tenant]], tenant
    assert receiver.duplicates == receiver.delayed == receiver.dead == 0
    assert svc.broker.queue_depth("billing.inbox") == 0
    svc.close()


class _AckLost:
    """A consumer whose acknowledgements are lost: what a receiver cut off after its commit
    leaves behind."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def ack_through(self, tag: int) -> None:
        pass

    def ack(self, tag: int) -> None:
        pass

    def forward(self, *args: Any) -> None:
        raise AssertionError("nothing is forwarded here")


def test_a_redelivered_copy_is_counted_and_dropped_in_its_tenants_inbox(
    db_url_factory: Callable[[], str], mq_url: str
) -> None:
    svc, _registry, where = _billing(db_url_factory, mq_url)
    first = _send_raw(mq_url, "acme")
    receiver = svc.receiver()
    consumer = svc.broker.consumer("billing.inbox", prefetch=10)
    batch: list[Delivery] = []
    wait_until(lambda: bool(batch.extend(consumer.fetch(10, 0.5)) or batch), what="a delivery")
    receiver.store(_AckLost(consumer), batch)  # type: ignore[arg-type]
    consumer.close()  # never acknowledged: it comes back, redelivered
    again = svc.broker.consumer("billing.inbox", prefetch=10)
    redelivered = again.fetch(10, 5)
    assert [d.redelivered for d in redelivered] == [True]
    receiver.store(again, redelivered)
    again.close()
    assert (receiver.stored, receiver.duplicates) == (1, 1)
    assert _inbox(where["acme"]) == [(first, "acme")]
    url = where["acme"].split("|")[0]
    # Counted where the tenant's copy is: its redelivery counter and duplicate count.
    assert scalar(url, "SELECT deliveries || '/' || duplicates FROM acme.inbox_deliveries") == "1/1"
    assert scalar(url, "SELECT count(*) FROM outbox_inbox.inbox_deliveries") == 0
    assert svc.broker.queue_depth("billing.inbox") == 0
    svc.close()


def _redelivered(svc: Service, receiver: Any) -> None:
    """Take the message in billing.inbox, lose it unacknowledged (a receiver killed before it
    stored it), and give its redelivered copy to `receiver`."""
    for redelivered in (False, True):
        consumer = svc.broker.consumer("billing.inbox", prefetch=10)
        batch = consumer.fetch(10, 5)
        assert [d.redelivered for d in batch] == [redelivered]
        if redelivered:
            receiver.store(consumer, batch)
        consumer.close()


def test_a_tenants_redelivered_dead_letter_is_replayed_with_its_counter_reset_in_its_tables(
    db_url_factory: Callable[[], str], mq_url: str, tmp_path: Path
) -> None:
    svc, _registry, where = _billing(db_url_factory, mq_url, max_redeliveries=1)
    message_id = _send_raw(mq_url, "gamma")
    gamma = svc.tenant("gamma")
    with gamma.engine.begin() as conn:  # a receiver killed after it counted a copy
        roles.count_deliveries(conn, gamma.tables, [uuid.UUID(message_id)])
    receiver = svc.receiver()
    _redelivered(svc, receiver)
    assert receiver.dead == 1  # counted twice, over the limit of 1
    DeadLetters.of(svc).replay([QUEUE], Filters(), audit_log=tmp_path / "audit.log")
    _redelivered(svc, receiver)  # the replayed copy, redelivered once: within the limit
    assert (receiver.dead, receiver.stored) == (1, 1)
    assert _inbox(where["gamma"]) == [(message_id, "gamma")]
    svc.close()


def test_an_unknown_tenant_is_retried_then_dead_lettered_and_replayed_once_it_is_registered(
    db_url_factory: Callable[[], str], mq_url: str, tmp_path: Path
) -> None:
    svc, registry, where = _billing(
        db_url_factory,
        mq_url,
        receive_retry=RetryPolicy(initial=0.1, multiplier=1, max_interval=0.1, max_attempts=2),
        delay_tiers=(0.2,),
    )
    lost = _send_raw(mq_url, "delta")
    receiver = svc.receiver()
    with running(receiver):
        wait_until(lambda: receiver.dead == 1, what="the unknown tenant's message dead")
    assert (receiver.delayed, receiver.stored) == (1, 0)  # once retried, then dead
    assert all(_inbox(place) == [] for place in where.values())
    letters = DeadLetters.of(svc)
    with letters.select([QUEUE], Filters()) as [selection]:
        assert [(d.message_id, d.reason) for d in selection.letters] == [(lost, "unknown_tenant")]

    registry["delta"] = Tenant(schema="delta")
    svc.tenant("delta").migrate()
    letters.replay([QUEUE], Filters(), audit_log=tmp_path / "audit.log")
    with running(receiver):
        wait_until(lambda: receiver.stored == 1, what="the replayed message stored")
    url = where["acme"].split("|")[0]
    assert _inbox(f"{url}|delta") == [(lost, "delta")]
    assert all(_inbox(place) == [] for place in where.values())
    svc.close()


def test_a_tenant_whose_database_is_down_waits_in_the_delay_queues_while_the_others_are_stored(
    db_url_factory: Callable[[], str], mq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    svc, _registry, where = _billing(
        db_url_factory,
        mq_url,
        receive_retry=RetryPolicy(initial=0.1, multiplier=1, max_interval=0.1, max_attempts=1000),
        delay_tiers=(0.2,),
    )
    gamma_url, gamma_db = where["gamma"].split("|")[0], where["gamma"].split("|")[0].rsplit("/")[-1]
    own_url = where[""].split("|")[0]

    def gamma_connections(allowed: bool) -> None:
        with svc.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'ALTER DATABASE "{gamma_db}" ALLOW_CONNECTIONS {allowed}'))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                {"d": gamma_db},
            )

    receiver = svc.receiver()
    with running(receiver):
        gamma_first = _send_raw(mq_url, "gamma")
        wait_until(lambda: receiver.stored == 1, what="gamma's first message")
        gamma_connections(False)
        caplog.set_level(logging.WARNING, logger="outbox_inbox.receiver")
        gamma = [_send_raw(mq_url, "gamma") for _ in range(3)]
        acme = [_send_raw(mq_url, "acme") for _ in range(3)]
        wait_until(lambda: receiver.stored == 4, what="acme's messages stored")
        wait_until(lambda: receiver.delayed >= 6, what="gamma's messages delayed twice")
        assert _inbox(where["acme"]) == [(m, "acme") for m in acme]
        gamma_connections(True)
        wait_until(lambda: receiver.stored == 7, what="gamma's messages stored once it is back")
    assert _inbox(where["gamma"]) == [(m, "gamma") for m in [gamma_first, *gamma]]
    assert _inbox(where[""]) == [] and receiver.dead == 0
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 1 and "gamma" in down[0].getMessage()  # one warning for the outage
    assert scalar(gamma_url, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 4
    assert own_url != gamma_url
    svc.close()


def test_maintenance_runs_on_every_tenant_and_a_tenant_down_is_logged_once(
    db_url_factory: Callable[[], str],
    mq_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    svc, registry, _where = _billing(db_url_factory, mq_url)
    registry["dead"] = Tenant(db_url=svc.settings.db_url.rsplit("/", 1)[0] + "/no_such_database")
    real, passes = partitions.maintain, []

    def counted(engine: Any, tables: Any, **options: Any) -> Any:
        result = real(engine, tables, **options)
        passes.append((engine.url.database, tables.metadata.schema))
        return result

    monkeypatch.setattr(partitions, "maintain", counted)
    caplog.set_level(logging.WARNING, logger="outbox_inbox.service")
    svc._maintain_quietly()
    svc._maintain_quietly()
    own, other = svc.engine.url.database, svc.tenant("gamma").engine.url.database
    expected = [(own, "outbox_inbox"), (own, "acme"), (own, "beta"), (other, "outbox_inbox")]
    assert passes == expected * 2
    failed = [r.getMessage() for r in caplog.records if "maintenance failed" in r.getMessage()]
    assert len(failed) == 1 and "tenant dead" in failed[0], failed
    svc.close()


def test_the_start_maintains_the_own_tables_and_the_role_the_tenants_spread_over_the_interval(
    db_url_factory: Callable[[], str], mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made, registry, _where = _billing(db_url_factory, mq_url)
    # A new process's service: acme and beta, idle, have no tenant Service (passes of their own).
    url, fast = made.settings.db_url, {**FAST, "maintenance_interval": 2.0}
    svc = Service("billing", db_url=url, mq_url=mq_url, tenants=registry, **fast)
    monkeypatch.setattr(service_module, "TENANT_MAINTENANCE_GAP", 1.0)  # > 2.0 / 4 parts
    real, passes = partitions.maintain, []

    def counted(engine: Any, tables: Any, **options: Any) -> Any:
        passes.append((tables.metadata.schema, time.monotonic()))
        return real(engine, tables, **options)

    monkeypatch.setattr(partitions, "maintain", counted)
    assert svc._wait_until_ready(topology=False, fail_fast=True)
    assert [p for p, _ in passes] == ["outbox_inbox"]  # a thousand tenants do not hold it up
    stop = threading.Event()
    role = threading.Thread(target=svc._maintenance, args=(stop,), kwargs={"on_started": list})
    role.start()  # a pass at once, its four parts 1 s apart (the gap): no burst of the tenants
    try:
        wait_until(lambda: len(passes) >= 7, timeout=20, what="a second pass begun")
    finally:
        stop.set()
        role.join(10)
    first = ["outbox_inbox", "acme", "beta", "outbox_inbox"]  # gamma's schema is outbox_inbox
    assert [p for p, _ in passes[1:7]] == [*first, "outbox_inbox", "acme"]
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(passes[1:7])]
    assert all(0.9 <= gap <= 3.0 for gap in gaps), gaps
    svc.close()
    made.close()


def test_a_spread_maintenance_pass_waits_its_gaps_while_the_database_is_down(
    db_url_factory: Callable[[], str], mq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, _registry, _where = _billing(db_url_factory, mq_url, maintenance_interval=2.0)
    monkeypatch.setattr(service_module, "TENANT_MAINTENANCE_GAP", 0.5)
    calls: list[str] = []

    def down(engine: Any, tables: Any, **options: Any) -> Any:
        calls.append(tables.metadata.schema)
        raise DatabaseUnavailable("the database is down")

    monkeypatch.setattr(partitions, "maintain", down)
    stop = threading.Event()
    role = threading.Thread(target=svc._maintenance, args=(stop,), kwargs={"on_started": list})
    role.start()
    time.sleep(3)
    stop.set()
    role.join(10)
    # 0.5 s apart (2.0 s / 4 parts): about 6 tries in 3 s, not a loop as fast as it can fail.
    assert 3 <= len(calls) <= 10, len(calls)
    svc.close()


def test_a_maintenance_pass_keeps_no_connection_to_a_tenants_own_database(
    db_url_factory: Callable[[], str], mq_url: str
) -> None:
    svc, _registry, _where = _billing(db_url_factory, mq_url)
    gamma = svc.tenant("gamma").engine
    gamma.dispose()
    sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"
    svc._maintain_quietly()  # the fleet disposes the pools it used; this pass, its own
    wait_until(lambda: scalar(svc.settings.db_url, sql, d=gamma.url.database) == 0, timeout=10)
    svc.close()


def test_an_idle_schema_tenants_maintenance_pass_does_its_work_and_keeps_nothing_of_it(
    db_url_factory: Callable[[], str], mq_url: str
) -> None:
    made, registry, _where = _billing(db_url_factory, mq_url)
    svc = Service("billing", db_url=made.settings.db_url, tenants=registry)  # none made yet
    parts = (
        "SELECT array_agg(c.relname::text ORDER BY c.relname DESC) FROM pg_inherits i JOIN"
        " pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'acme.outbox_messages'::regclass"
    )
    made_ahead = scalar(svc.settings.db_url, parts)
    # The newest three: the migration makes a day more in the last two hours of a UTC day, so
    # one or two of them are within the days a maintenance pass keeps made ahead.
    with svc.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {', '.join(f'acme.{p}' for p in made_ahead[:3])}"))
    kept_until = partitions.floor_time(scalar(svc.settings.db_url, "SELECT now()"), "day")
    kept_until += partitions.INTERVALS["day"] * partitions.AHEAD["day"]
    starts = {p: datetime.strptime(p[-8:], "%Y%m%d").replace(tzinfo=UTC) for p in made_ahead[:3]}
    remade = [p for p in made_ahead[:3] if starts[p] < kept_until]
    assert remade
    svc.maintain()
    compiled = len(svc.engine._compiled_cache or {})  # the service's own pass's statements
    build_tables.cache_clear()
    svc._maintain_quietly()
    assert build_tables.cache_info().currsize == 1  # gamma's schema, outbox_inbox
    assert scalar(svc.settings.db_url, parts) == remade + made_ahead[3:]  # made again by acme
    # acme and beta left nothing behind; gamma, in a database of its own, is kept as before.
    assert [key[0] for key in svc._tenant_services] == ["gamma"]
    assert len(svc.engine._compiled_cache or {}) == compiled
    svc.close()
    made.close()


def test_db_upgrade_migrates_every_tenant_names_those_that_failed_and_resumes(
    db_url_factory: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = db_url_factory()
    (tmp_path / "tenants_cli_app.py").write_text(
        "import json, os\n"
        "from outbox_inbox import Service, Tenant\n"
        "def billing():\n"
        "    spec = json.loads(os.environ['TENANTS_APP'])\n"
        "    tenants = {t: Tenant(**entry) for t, entry in spec['tenants'].items()}\n"
        "    return Service('billing', db_url=spec['db_url'], tenants=tenants)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    dead = own.rsplit("/", 1)[0] + "/no_such_database"
    spec: dict[str, Any] = {"db_url": own, "tenants": {"acme": {"schema": "acme"}}}
    spec["tenants"]["beta"] = {"db_url": dead}  # fails; the tenant after it is migrated still
    spec["tenants"]["gamma"] = {"schema": "gamma"}

    def upgrade() -> Any:
        env = {"TENANTS_APP": json.dumps(spec), "OUTBOX_INBOX_DB_URL": None}
        return CliRunner().invoke(db, ["upgrade", "--app", "tenants_cli_app:billing"], env=env)

    first = upgrade()
    assert first.exit_code == 1, first.output
    lines = first.stdout.splitlines()
    assert lines[0].startswith("upgraded") and lines[0].endswith("schema outbox_inbox to heads")
    assert lines[1].startswith("tenant acme: upgraded") and "schema acme" in lines[1]
    assert lines[2].startswith("tenant beta: failed: ")
    assert lines[3].startswith("tenant gamma: upgraded") and "schema gamma" in lines[3]
    assert "1 tenant(s) failed: beta" in first.stderr
    for schema in ("outbox_inbox", "acme", "gamma"):
        assert scalar(own, f"SELECT count(*) FROM {schema}.inbox_messages") == 0

    spec["tenants"]["beta"] = {"db_url": db_url_factory()}  # the tenant's database fixed
    second = upgrade()
    assert second.exit_code == 0, second.output
    lines = second.stdout.splitlines()
    assert lines[1] == "tenant acme: schema acme is at the newest revision"
    assert lines[2].startswith("tenant beta: upgraded")
    assert lines[3] == "tenant gamma: schema gamma is at the newest revision"
    beta = spec["tenants"]["beta"]["db_url"]
    assert scalar(beta, "SELECT count(*) FROM outbox_inbox.inbox_messages") == 0
