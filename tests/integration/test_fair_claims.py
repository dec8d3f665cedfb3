"""Fair claims and concurrency caps, on the real PostgreSQL (and the same order on SQLite).

The worker's claim serves the message types waiting in turn within a priority, keeps each
ordering key's order and holds a key behind its failing head; a handler's ``max_concurrency``
is never exceeded by the workers of several processes and service instances together, and a
message a cap holds back is neither leased nor counted as an attempt. Everything is counted in
claims and batches, never timed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Connection, event, text

from helpers import as_prepared, make_service, received_row, rows, scalar, wait_until
from outbox_inbox import ConfigurationError, Message, Service
from outbox_inbox.metrics import instrument
from outbox_inbox.queries import roles
from outbox_inbox.status import collect_status
from outbox_inbox.worker import Worker

INBOX = "outbox_inbox.inbox_messages"
LEASE = timedelta(seconds=60)


def _service(db_url: str, types: tuple[str, ...], **settings: Any) -> tuple[Service, list[str]]:
    """billing with a handler of each command of `types` that notes the types it handled,
    in order."""
    service = make_service("billing", db_url, None, **settings)
    handled: list[str] = []
    for command in types:

        def handle(message: Message, session: Any) -> None:
            handled.append(message.type.removeprefix("billing."))

        service.on_command(command)(handle)
    return service, handled


def _store(service: Service, command: str, count: int, **values: Any) -> None:
    rk = f"billing.{command}"
    with service.engine.begin() as conn:
        roles.insert_inbox(
            conn, service.tables, [received_row(routing_key=rk, **values) for _ in range(count)]
        )


@contextmanager
def _connected(worker: Worker) -> Iterator[Connection]:
    conn = worker.connect()
    try:
        yield conn
    finally:
        worker.give_back(conn)
        conn.close()
        worker.close_liveness()


def _billing(db_url: str, tmp_path: Path, where: str, **settings: Any) -> Service:
    """billing with `settings`, on the test's PostgreSQL or (`where` "sqlite") a SQLite file."""
    if where == "postgresql":
        return make_service("billing", db_url, None, **settings)
    sqlite = f"sqlite:///{tmp_path / 'billing.db'}"
    service = Service("billing", db_url=sqlite, mq_url=None, **settings)
    service.migrate()
    return service


def _drain(service: Service) -> None:
    """One worker of `service` works until nothing is due."""
    worker = service.worker()
    with _connected(worker) as conn:
        while worker.work_once(conn):
            pass


@pytest.mark.parametrize("batch", [1, 3])
def test_three_types_with_five_waiting_each_are_served_in_turn(db_url: str, batch: int) -> None:
    service, handled = _service(db_url, ("a.run", "b.run", "c.run"), worker_batch_size=batch)
    for command in ("a.run", "b.run", "c.run"):
        _store(service, command, 5)
    _drain(service)
    assert handled == ["a.run", "b.run", "c.run"] * 5
    service.close()


@pytest.mark.parametrize("batch", [4, 20])
@pytest.mark.parametrize("where", ["postgresql", "sqlite"])
def test_a_type_of_weight_three_gets_three_turns_to_each_turn_of_the_others(
    db_url: str, tmp_path: Path, batch: int, where: str
) -> None:
    service = _billing(db_url, tmp_path, where, worker_batch_size=batch)
    handled: list[str] = []
    for command, weight in (("a.run", 3), ("b.run", None)):

        def handle(message: Message, session: Any) -> None:
            handled.append(message.type.removeprefix("billing."))

        service.on_command(command, weight=weight)(handle)
    _store(service, "a.run", 6)
    _store(service, "b.run", 4)
    _drain(service)
    assert handled == (["a.run"] * 3 + ["b.run"]) * 2 + ["b.run"] * 2
    service.close()


def test_a_weight_applies_to_one_routing_key(db_url: str) -> None:
    service = make_service("billing", db_url, None)
    with pytest.raises(ConfigurationError, match="weight applies to one routing key"):
        service.on_event("orders.#", weight=2)(lambda message, session: None)
    with pytest.raises(ConfigurationError, match="weight must be an int >= 1"):
        service.on_command("a.run", weight=0)(lambda message, session: None)
    service.close()


def test_with_fair_claims_off_the_types_are_served_in_arrival_order(db_url: str) -> None:
    service, handled = _service(db_url, ("a.run", "b.run"), fair_claims=False)
    for command in ("a.run", "b.run"):
        _store(service, command, 3)
    _drain(service)
    assert handled == ["a.run"] * 3 + ["b.run"] * 3
    service.close()


@pytest.mark.parametrize("fair", [True, False])
def test_urgent_commands_sent_during_a_backlog_are_handled_within_two_batches(
    db_url: str, fair: bool
) -> None:
    service, handled = _service(
        db_url, ("bulk.item", "urgent.ping"), worker_batch_size=10, fair_claims=fair
    )
    _store(service, "bulk.item", 300)
    worker = service.worker()
    with _connected(worker) as conn:
        for _ in range(3):
            worker.work_once(conn)
        _store(service, "urgent.ping", 5)
        # The batch in hand was claimed before the urgent commands came: the one after it
        # is the first that can serve them.
        batches = [Counter(handled[-10:]) for _ in range(2) if worker.work_once(conn)]
    urgent = sum(b["urgent.ping"] for b in batches)
    if fair:
        assert urgent == 5
        assert batches[-1]["urgent.ping"] == 5  # in one batch, each beside a bulk item
    else:
        assert urgent == 0  # behind the whole backlog
    service.close()


def test_a_type_spread_over_many_keys_gets_no_more_than_its_share(db_url: str) -> None:
    service, handled = _service(db_url, ("split.run", "whole.run"), worker_batch_size=10)
    with service.engine.begin() as conn:
        spread = [
            received_row(routing_key="billing.split.run", key=f"k{n % 100}") for n in range(200)
        ]
        roles.insert_inbox(conn, service.tables, spread)
    _store(service, "whole.run", 200)
    worker = service.worker()
    with _connected(worker) as conn:
        for _ in range(10):
            worker.work_once(conn)
    share = Counter(handled[:100])
    assert share == {"split.run": 50, "whole.run": 50}
    service.close()


def _tenants(
    db_url: str, tmp_path: Path, where: str, cap: int | None = None, **settings: Any
) -> tuple[Service, list[str]]:
    """`_billing` with a ``job.run`` handler (of `cap`) that notes the tenant of each message
    it handled, in order."""
    service = _billing(db_url, tmp_path, where, **settings)
    handled: list[str] = []
    record = lambda message, session: handled.append(message.tenant)  # noqa: E731
    service.on_command("job.run", max_concurrency=cap)(record)
    return service, handled


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("where", ["postgresql", "sqlite"])
def test_the_tenants_of_one_type_are_served_in_turn(
    db_url: str, tmp_path: Path, where: str, batch: int
) -> None:
    service, handled = _tenants(db_url, tmp_path, where, worker_batch_size=batch)
    for tenant in ("acme", "bolt", "cask"):
        _store(service, "job.run", 5, tenant=tenant)
    _drain(service)
    assert handled == ["acme", "bolt", "cask"] * 5
    service.close()


@pytest.mark.parametrize("batch", [4, 20])
@pytest.mark.parametrize("where", ["postgresql", "sqlite"])
def test_a_tenant_of_weight_three_gets_three_turns_to_each_turn_of_the_others(
    db_url: str, tmp_path: Path, where: str, batch: int
) -> None:
    weights = {"acme": 3}
    service, handled = _tenants(
        db_url, tmp_path, where, worker_batch_size=batch, tenant_weights=weights
    )
    _store(service, "job.run", 6, tenant="acme")
    _store(service, "job.run", 4, tenant="bolt")
    _drain(service)
    assert handled == (["acme"] * 3 + ["bolt"]) * 2 + ["bolt"] * 2
    with pytest.raises(ConfigurationError, match="tenant_weights must map"):
        Service("billing", db_url=db_url, mq_url=None, tenant_weights={"acme": 0})
    service.close()


def test_a_tenant_spread_over_many_keys_gets_no_more_than_its_share(db_url: str) -> None:
    service, handled = _tenants(db_url, Path(), "postgresql", worker_batch_size=10)
    with service.engine.begin() as conn:
        spread = [
            received_row(routing_key="billing.job.run", key=f"k{n % 100}", tenant="split")
            for n in range(200)
        ]
        roles.insert_inbox(conn, service.tables, spread)
    _store(service, "job.run", 200, tenant="whole")
    worker = service.worker()
    with _connected(worker) as conn:
        for _ in range(10):
            worker.work_once(conn)
    assert Counter(handled[:100]) == {"split": 50, "whole": 50}
    service.close()


@pytest.mark.parametrize("where", ["postgresql", "sqlite"])
def test_a_capped_types_places_go_to_its_tenants_in_turn(
    db_url: str, tmp_path: Path, where: str
) -> None:
    """With a cap of one, each claim takes one row of the type: the tenant after the last one
    served gets it, not the oldest row's tenant every time."""
    service, handled = _tenants(db_url, tmp_path, where, cap=1)
    for tenant in ("acme", "bolt"):
        _store(service, "job.run", 3, tenant=tenant)
    _drain(service)
    assert handled == ["acme", "bolt"] * 3
    service.close()


def test_priorities_come_before_the_turns_of_the_types(db_url: str) -> None:
    service, handled = _service(db_url, ("a.run", "b.run", "c.run"), worker_batch_size=4)
    _store(service, "a.run", 3)
    _store(service, "b.run", 3, priority=5)
    _store(service, "c.run", 3, priority=5)
    _drain(service)
    # Batches of 4, each handled in the order served: b1 c1 b2 c2 | b3 c3 a1 a2 | a3.
    assert handled == ["b.run", "c.run"] * 3 + ["a.run"] * 3
    service.close()


def test_a_key_keeps_its_order_and_is_held_behind_its_failing_head(db_url: str) -> None:
    service, _ = _service(db_url, ("a.run", "b.run"))
    engine, tables = service.engine, service.tables
    with engine.begin() as conn:
        keyed = [received_row(routing_key="billing.a.run", key="k1") for _ in range(3)]
        roles.insert_inbox(conn, tables, keyed)
    _store(service, "b.run", 3)
    first, second, _third = (
        r[0] for r in rows(db_url, f"SELECT id FROM {INBOX} WHERE key = 'k1' ORDER BY id")
    )

    def claim() -> list[int]:
        with engine.begin() as conn:
            return [r["id"] for r in roles.claim_inbox(conn, tables, "w", 10, timedelta(0))]

    claimed = claim()
    assert first in claimed and second not in claimed and len(claimed) == 4
    with engine.begin() as conn:
        roles.mark_retry(conn, tables, first, "failed", timedelta(seconds=60))
        roles.mark_processed(conn, tables, [i for i in claimed if i != first])
    assert claim() == []  # the key is held behind its head, which waits for its retry
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE {INBOX} SET next_attempt_at = now() WHERE id = :i"), {"i": first}
        )
        roles.mark_processed(conn, tables, [first])
    assert claim() == [second]
    service.close()


def test_a_message_held_back_by_a_cap_is_neither_leased_nor_counted(db_url: str) -> None:
    service = make_service("billing", db_url, None)
    engine, tables = service.engine, service.tables
    _store(service, "job.run", 3)
    caps = {"billing.job.run": 1}

    def claim(worker: str) -> list[int]:
        with engine.begin() as conn:
            claimed = roles.claim_inbox(conn, tables, worker, 10, LEASE, caps=caps)
            return [r["id"] for r in claimed]

    # Claimants without a liveness lock: their rows are theirs for the lease.
    [first] = claim("w-1" + roles.LEASE_ONLY)
    assert claim("w-2" + roles.LEASE_ONLY) == []
    assert rows(db_url, f"SELECT attempts, locked_by FROM {INBOX} WHERE id <> {first}") == [
        (0, None),
        (0, None),
    ]
    with engine.begin() as conn:
        roles.mark_processed(conn, tables, [first])
    assert len(claim("w-2" + roles.LEASE_ONLY)) == 1  # as soon as the cap allows
    service.close()


def test_status_and_metrics_show_each_types_waiting_work_and_a_cap_that_holds_it_back(
    db_url: str,
) -> None:
    service = make_service("billing", db_url, None)
    service.on_command("job.run", max_concurrency=1)(lambda message, session: None)
    service.on_command("mail.send")(lambda message, session: None)
    engine, tables = service.engine, service.tables
    registry = CollectorRegistry()
    instrument(service, registry=registry)
    _store(service, "job.run", 3)
    _store(service, "mail.send", 2)
    with engine.begin() as conn:  # what a worker of this service advertises
        advertised = service.handlers.advertised()
        roles.advertise_instance(conn, tables, "billing", "i-1", advertised, forget_after=LEASE)

    def shown() -> dict[str, tuple[Any, ...]]:
        report = collect_status(engine, tables, service="billing", admin=None)
        return {
            t["type"]: (t["pending"], t["in_progress"], t["cap"], t["cap_binding"])
            for t in report["inbox"]["by_type"]
        }

    def gauge(name: str, command: str) -> float | None:
        labels = {"service": "billing", "type": f"billing.{command}"}
        return registry.get_sample_value(f"outbox_inbox_inbox_{name}", labels)

    caps = service.handlers.per_key("max_concurrency")
    assert shown()["billing.job.run"] == (3, 0, 1, False)  # nothing held back yet
    with engine.begin() as conn:
        roles.claim_inbox(conn, tables, "w-1" + roles.LEASE_ONLY, 10, LEASE, caps=caps)
    assert shown() == {"billing.job.run": (2, 1, 1, True), "billing.mail.send": (0, 2, None, False)}
    assert (gauge("type_pending", "job.run"), gauge("cap_binding", "job.run")) == (2, 1)
    assert (gauge("type_pending", "mail.send"), gauge("cap_binding", "mail.send")) == (0, None)
    service.close()


def test_status_and_metrics_show_the_tenants_with_the_most_work_waiting(db_url: str) -> None:
    service = make_service("billing", db_url, None)
    registry = CollectorRegistry()
    instrument(service, registry=registry)
    for tenant, count in (("acme", 3), ("bolt", 1), ("", 2)):
        _store(service, "job.run", count, tenant=tenant)
    with service.engine.begin() as conn:
        roles.claim_inbox(conn, service.tables, "w-1" + roles.LEASE_ONLY, 1, LEASE)
    inbox = collect_status(service.engine, service.tables, service="billing", admin=None)["inbox"]
    assert inbox["tenants_waiting"] == 2  # "" is no tenant
    assert inbox["by_tenant"] == [
        {"tenant": "acme", "pending": 2, "in_progress": 1},
        {"tenant": "bolt", "pending": 1, "in_progress": 0},
    ]
    sample = registry.get_sample_value
    assert sample("outbox_inbox_inbox_tenants_waiting", {"service": "billing"}) == 2
    labels = {"service": "billing", "tenant": "acme"}
    assert sample("outbox_inbox_inbox_tenant_pending", labels) == 2
    service.close()


def test_a_cap_of_two_gives_its_places_to_two_workers_not_both_to_the_first(db_url: str) -> None:
    service = make_service("billing", db_url, None)
    _store(service, "job.run", 5)
    caps = {"billing.job.run": 2}

    def claimed(worker: str) -> int:
        with service.engine.begin() as conn:
            return len(roles.claim_inbox(conn, service.tables, worker, 10, LEASE, caps=caps))

    # A worker runs its batch one message at a time: both places in one claim would run one.
    assert [claimed(f"w-{n}" + roles.LEASE_ONLY) for n in (1, 2, 3)] == [1, 1, 0]
    service.close()


_CAPPED_APP = """
import sys, threading, time
from sqlalchemy import create_engine, text
from outbox_inbox import Service

db_url, cap = sys.argv[1], int(sys.argv[2])
gauge = create_engine(db_url, isolation_level="AUTOCOMMIT")
stop = threading.Event()
threads = []
for instance in range(2):
    service = Service("billing", db_url=db_url, mq_url=None, worker_batch_size=5,
                      worker_poll_interval=0.05)

    @service.on_command("job.run", max_concurrency=cap or None)
    def handle(message, session):
        with gauge.connect() as conn:
            running = conn.execute(text("UPDATE gauge SET n = n + 1 RETURNING n")).scalar_one()
            conn.execute(text("INSERT INTO seen (running) VALUES (:n)"), {"n": running})
            time.sleep(0.02)
            conn.execute(text("UPDATE gauge SET n = n - 1"))

    for _ in range(2):
        thread = threading.Thread(target=service.worker().run, args=(stop,))
        thread.start()
        threads.append(thread)
sys.stdin.read()  # until the test closes it
stop.set()
for thread in threads:
    thread.join(30)
"""


@pytest.mark.parametrize("cap", [2, 0])
def test_a_cap_is_never_exceeded_by_two_processes_of_two_instances(
    db_url: str, tmp_path: Path, cap: int
) -> None:
    service = make_service("billing", db_url, None)
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE gauge (n int NOT NULL)"))
        conn.execute(text("INSERT INTO gauge VALUES (0)"))
        conn.execute(text("CREATE TABLE seen (running int NOT NULL)"))
    _store(service, "job.run", 60)
    app = tmp_path / "capped_app.py"
    app.write_text(textwrap.dedent(_CAPPED_APP))
    children = [
        subprocess.Popen([sys.executable, str(app), db_url, str(cap)], stdin=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        wait_until(
            lambda: (
                scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE status = 'processed'") == 60
            ),
            timeout=120,
            what="every job handled",
        )
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            child.wait(60)
    assert scalar(db_url, "SELECT count(*) FROM seen") == 60
    most = scalar(db_url, "SELECT max(running) FROM seen")
    if cap:
        assert most <= cap
        assert scalar(db_url, f"SELECT max(attempts) FROM {INBOX}") == 1
    else:
        assert most > 2  # the same fleet without the cap runs more at once
    service.close()


def test_sqlite_serves_the_types_in_the_same_turns(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'billing.db'}"
    service = Service("billing", db_url=db_url, mq_url=None, worker_batch_size=1)
    service.migrate()
    handled: list[str] = []
    for command in ("a.run", "b.run", "c.run"):

        def handle(message: Message, session: Any) -> None:
            handled.append(message.type.removeprefix("billing."))

        service.on_command(command)(handle)
    for command in ("a.run", "b.run", "c.run"):
        _store(service, command, 5)
    _store(service, "a.run", 1, priority=5)
    _drain(service)
    # The turn after the urgent a.run goes on from the next type.
    assert handled == ["a.run"] + ["b.run", "c.run", "a.run"] * 5
    service.close()


def test_a_batch_of_one_type_is_left_in_the_order_it_was_claimed_in() -> None:
    """`served_order` returns a batch of one routing key as it is (by priority, then id: its
    turns follow that order), without sorting it again; a batch of two types it puts in turns."""
    a = "billing.a"
    one = [
        {"id": n, "priority": p, "routing_key": a, "tenant": ""}
        for n, p in ((1, 5), (2, 0), (3, 0))
    ]
    after = ("billing.b", "")
    assert roles.served_order(one, after, {"billing.a": 2}) is one  # type: ignore[arg-type]
    two = [*one, {"id": 4, "priority": 0, "routing_key": "billing.b", "tenant": ""}]
    assert [r["id"] for r in roles.served_order(two, ("", ""))] == [1, 2, 4, 3]  # type: ignore[arg-type]


def _sorted_rows(plan: Any) -> int:
    """The most rows any Sort node of an EXPLAIN (ANALYZE, FORMAT JSON) plan was fed."""
    node = plan[0]["Plan"] if isinstance(plan, list) else plan
    children = node.get("Plans", [])
    fed = [c["Actual Rows"] * c["Actual Loops"] for c in children]
    own = sum(fed) if node["Node Type"] == "Sort" else 0
    return max([own, *(_sorted_rows(child) for child in children)])


def _no_autovacuum(service: Service, db_url: str) -> None:
    """Autovacuum (and its analyze) off on every partition of the inbox."""
    partitions = rows(
        db_url,
        "SELECT inhrelid::regclass::text FROM pg_inherits"
        " WHERE inhparent = 'outbox_inbox.inbox_messages'::regclass",
    )
    with service.engine.begin() as conn:
        for (partition,) in partitions:
            conn.execute(text(f"ALTER TABLE {partition} SET (autovacuum_enabled = false)"))


def test_a_claim_planned_on_an_empty_inbox_reads_its_heads_not_the_whole_backlog_later(
    db_url: str,
) -> None:
    """The worker's claim is a prepared statement whose generic plan the connection keeps
    (`roles.limit_worker`). Planned while the inbox is empty, as at a start, that plan must
    not sort every pending row once a backlog has come: the claim's settings see to it."""
    service = make_service("billing", db_url, None)
    engine, tables = service.engine, service.tables
    _no_autovacuum(service, db_url)  # no analyze of its own while the test runs
    with engine.begin() as conn:
        conn.execute(text("ANALYZE outbox_inbox.inbox_messages"))  # empty, as at a start
    sent: list[tuple[str, Any]] = []  # the claim as the driver gets it: SQL and values

    def note(conn: Any, cursor: Any, statement: str, values: Any, *_: Any) -> None:
        sent.append((statement, values))

    with engine.connect() as conn, conn.begin() as transaction:
        event.listen(conn, "before_cursor_execute", note)
        roles.claim_inbox(conn, tables, "w-1" + roles.LEASE_ONLY, 50, LEASE)
        transaction.rollback()
    [(settings, set_values), (claim, values)] = sent  # the settings, then the claim
    assert "set_config" in settings and "enable_sort" in str(set_values)
    assert "jit" in str(set_values)  # never compiled: that took seconds, for a 1 ms claim
    numbered, names = as_prepared(claim)
    kinds = {bool: "bool", int: "int8", float: "float8", str: "text"}
    types = ", ".join(kinds[type(values[name])] for name in names)
    arguments = [values[name] for name in names]
    sessions = {settings: psycopg.connect(db_url.replace("+psycopg", "")) for settings in (0, 1)}

    def sorted_by_a_claim(settings: int) -> int:
        session = sessions[settings]
        with session.transaction(force_rollback=True):
            if settings:
                literal = {"literal_binds": True}  # what claim_inbox runs before its claim
                session.execute(
                    str(roles._CLAIM_SETTINGS[True, False].compile(engine, compile_kwargs=literal))
                )
            given = psycopg.sql.SQL(", ").join(map(psycopg.sql.Literal, arguments))
            explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim({})")
            plan = session.execute(explain.format(given)).fetchone()
        assert plan is not None
        return _sorted_rows(plan[0])

    try:
        for session in sessions.values():
            session.execute("SET plan_cache_mode = force_generic_plan")
            session.execute(f"PREPARE claim ({types}) AS {numbered}")
            sorted_by_a_claim(0)  # planned now, on the empty inbox, and kept
        _store(service, "bulk.item", 3000)
        assert sorted_by_a_claim(0) >= 3000  # the backlog sorted: what the settings avoid
        assert sorted_by_a_claim(1) <= 100
    finally:
        for session in sessions.values():
            session.close()
        service.close()


def _node(plan: Any, name: str) -> Any:
    """The node of an EXPLAIN (FORMAT JSON) plan whose subplan is `name` (None if none)."""
    node = plan[0]["Plan"] if isinstance(plan, list) else plan
    if node.get("Subplan Name") == name:
        return node
    return next(filter(None, (_node(c, name) for c in node.get("Plans", []))), None)


def _claim_to_prepare(service: Service, **options: Any) -> tuple[str, Any, str, Any]:
    """A claim of 50 by ``w-1`` with `options` (`_to_prepare`)."""
    return _to_prepare(
        service, lambda conn: roles.claim_inbox(conn, service.tables, "w-1", 50, LEASE, **options)
    )


def _to_prepare(service: Service, run: Callable[[Connection], Any]) -> tuple[str, Any, str, Any]:
    """What `run` sends, as the driver got it (rolled back): the settings statement it sends
    first and its values, its last statement's text for ``PREPARE`` ($n parameters) and that
    statement's values for ``EXECUTE``."""
    sent: list[tuple[str, Any]] = []

    def note(conn: Any, cursor: Any, statement: str, values: Any, *_: Any) -> None:
        sent.append((statement, values))

    with service.engine.connect() as conn, conn.begin() as transaction:
        event.listen(conn, "before_cursor_execute", note)
        run(conn)
        transaction.rollback()
    (settings, set_values), *_, (last, values) = sent
    assert "set_config" in settings
    numbered, names = as_prepared(last)
    given = psycopg.sql.SQL(", ").join(psycopg.sql.Literal(values[name]) for name in names)
    return settings, set_values, numbered, given


def _scanned(node: Any, kinds: tuple[str, ...] = ("Seq Scan",)) -> int:
    """The rows the scan nodes of `kinds` of an EXPLAIN (ANALYZE, FORMAT JSON) plan read."""
    read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
    own = read * node["Actual Loops"] if node["Node Type"] in kinds else 0
    return own + sum(_scanned(child, kinds) for child in node.get("Plans", []))


#: Every scan of a table or an index: what the receiver's insert reads to find the ids stored.
ANY_SCAN = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan")


@pytest.mark.parametrize("statement", ["claim", "insert"])
def test_a_plan_made_on_an_empty_inbox_still_finds_rows_by_index_once_thousands_are_there(
    db_url: str, statement: str
) -> None:
    """The worker's claim and the receiver's insert are prepared statements whose generic plan
    a connection keeps. Made while the inbox is empty, as at a start, such a plan reads the
    whole inbox at each call once thousands of rows are there: by a Seq Scan for the claim's
    rows by id; for the ids already stored, by a Seq Scan, or a join over the whole index of
    message ids. The settings each sends first keep the claim on its indexes; the insert
    probes that index for each id it stores (none of the 50 new ids is found: nothing read)."""
    service = make_service("billing", db_url, None)
    _no_autovacuum(service, db_url)  # no analyze of its own while the test runs
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as c:
        c.execute(f"VACUUM ANALYZE {INBOX}")  # empty, as at a start
    new = [received_row() for _ in range(50)]
    settings, set_values, numbered, given = _to_prepare(
        service,
        lambda conn: (
            roles.claim_inbox(conn, service.tables, "w-1", 50, LEASE)
            if statement == "claim"
            else roles.insert_inbox(conn, service.tables, new, bound=True)  # as the receiver
        ),
    )
    sessions = {sent: psycopg.connect(db_url.replace("+psycopg", "")) for sent in (False, True)}

    def scanned(session: psycopg.Connection[Any], sent: bool) -> int:
        with session.transaction(force_rollback=True):
            if sent:
                session.execute(settings, set_values)
            explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE s({})")
            plan = session.execute(explain.format(given)).fetchone()
        assert plan is not None
        return _scanned(plan[0][0]["Plan"], ANY_SCAN if statement == "insert" else ("Seq Scan",))

    try:
        for sent, session in sessions.items():
            session.execute("SET plan_cache_mode = force_generic_plan")
            session.execute(f"PREPARE s AS {numbered}")
            scanned(session, sent)  # planned now, on the empty inbox, and kept
        _store(service, "bulk.item", 3000)
        assert scanned(sessions[False], False) >= 3000  # what the settings avoid
        assert scanned(sessions[True], True) <= 50
    finally:
        for session in sessions.values():
            session.close()
        service.close()


@pytest.mark.parametrize("statement", ["claim", "mark"])
def test_the_relays_plans_made_on_an_empty_outbox_read_only_the_rows_they_take_later(
    db_url: str, statement: str
) -> None:
    """The relay's transactions keep one generic plan a statement (`roles.bound_on_server`),
    made at a start on an empty outbox. Run on 3,000 unsent rows, its claim reads the 250 it
    takes and its mark the 50 it marks, by their indexes: no plan reads the outbox whole."""
    service = make_service("orders", db_url, None)
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as c:
        c.execute("VACUUM ANALYZE outbox_inbox.outbox_messages")  # empty, as at a start
    settings, set_values, numbered, given = _to_prepare(
        service,
        lambda conn: (
            roles.bound_on_server(conn, flush_wait=False),  # as the relay
            roles.claim_outbox(conn, service.tables, 250)
            if statement == "claim"
            else roles.mark_published(conn, service.tables, list(range(100, 150))),
        ),
    )
    # Autocommit: each EXPLAIN in a transaction of its own, whose now() follows the writes.
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as session:
        session.execute(f"PREPARE s AS {numbered}")

        def scanned() -> int:
            with session.transaction(force_rollback=True):
                session.execute(settings, set_values)
                explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE s({})")
                plan = session.execute(explain.format(given)).fetchone()
            assert plan is not None
            return _scanned(plan[0][0]["Plan"], ANY_SCAN)

        assert scanned() == 0  # planned now, on the empty outbox, and kept
        with service.session() as business, business.begin():
            for n in range(3000):
                service.outbox.publish(business, "order.placed", {"n": n})
        assert scanned() <= (250 if statement == "claim" else 50)
    service.close()


def test_a_claim_finds_the_waiting_types_without_reading_the_rows_handled_before(
    db_url: str,
) -> None:
    """The rows a drain has handled stay in the index of pending rows by type until a vacuum,
    before each type's waiting rows. The fair claim finds the types waiting from the other end
    of that index: the pages it reads for them do not grow with the rows handled."""
    service = make_service("billing", db_url, None)
    _no_autovacuum(service, db_url)  # no vacuum while the test runs
    _store(service, "bulk.item", 6000)
    settings, set_values, numbered, given = _claim_to_prepare(service)
    explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim({})")

    def pages_read_for_the_types() -> int:
        with session.transaction(force_rollback=True):
            session.execute(settings, set_values)
            plan = session.execute(explain.format(given)).fetchone()
        assert plan is not None
        probe = _node(plan[0], "CTE groups")
        return int(probe["Shared Hit Blocks"] + probe["Shared Read Blocks"])

    session = psycopg.connect(db_url.replace("+psycopg", ""))
    try:
        session.execute("SET plan_cache_mode = force_generic_plan")
        session.execute(f"PREPARE claim AS {numbered}")
        before = pages_read_for_the_types()
        session.execute(
            f"UPDATE {INBOX} SET status = 'processed', processed_at = now()"
            f" WHERE id < (SELECT max(id) - 50 FROM {INBOX})"
        )
        session.commit()
        after = [pages_read_for_the_types() for _ in range(2)]  # the second: entries marked dead
        assert max(after) <= before + 2, (before, after)
    finally:
        session.close()
        service.close()


@pytest.mark.parametrize("fair", [True, False])
def test_a_claims_generic_plan_leases_its_rows_by_id_not_by_reading_the_inbox(
    db_url: str, fair: bool
) -> None:
    """The claim leases the rows it picked found by id. Given as ``IN (subquery)``, the
    server's generic plan of the worker's prepared claim joined them to every row of an inbox
    of a few thousand rows (a hash join over a full scan)."""
    service = make_service("billing", db_url, None)
    _store(service, "job.run", 5000)
    with service.engine.begin() as conn:
        conn.execute(text("ANALYZE outbox_inbox.inbox_messages"))
    settings, set_values, numbered, given = _claim_to_prepare(service, fair=fair)
    explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim({})")
    with psycopg.connect(db_url.replace("+psycopg", "")) as session:
        session.execute("SET plan_cache_mode = force_generic_plan")
        session.execute(f"PREPARE claim AS {numbered}")
        with session.transaction(force_rollback=True):
            session.execute(settings, set_values)
            plan = session.execute(explain.format(given)).fetchone()
    assert plan is not None
    assert _scanned(plan[0][0]["Plan"]) == 0
    service.close()
