"""Rate caps (a handler's ``rate=(n, seconds)``), on the real PostgreSQL and on SQLite.

A claim takes at most n less the type's rows claimed within the last `seconds` of the
database clock (counted per tenth of the period in inbox_rate_counts), under the capped type's
transaction lock. Counted in claims and rows, never timed: a period of an hour never passes
during a test, and the test of a short period checks the rows' own times on the database clock.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from helpers import make_service, received_row, scalar, wait_until
from outbox_inbox import ConfigurationError, Service
from outbox_inbox.dashboard.views import cap_shown
from outbox_inbox.metrics import instrument
from outbox_inbox.queries import roles
from outbox_inbox.status import collect_status

INBOX = "outbox_inbox.inbox_messages"
LEASE = timedelta(seconds=60)
HOUR = 3600.0
JOB = "billing.job.run"


@pytest.fixture(params=["postgresql", "sqlite"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """billing, migrated, on a fresh PostgreSQL database or SQLite file."""
    if request.param == "postgresql":
        made = make_service("billing", request.getfixturevalue("db_url"), None)
    else:
        sqlite = f"sqlite:///{tmp_path / 'billing.db'}"
        made = Service("billing", db_url=sqlite, mq_url=None, worker_poll_interval=0.1)
        made.migrate()
    yield made
    made.close()


def _store(service: Service, routing_key: str, count: int) -> None:
    with service.engine.begin() as conn:
        rows = [received_row(routing_key=routing_key) for _ in range(count)]
        roles.insert_inbox(conn, service.tables, rows)


def _claim(service: Service, worker: str, **caps: Any) -> list[Any]:
    """A claim of up to 10 rows by `worker`, without a liveness lock (its rows are its own for
    the lease), with `caps` (``rates``, ``caps``, ``fair``)."""
    with service.engine.begin() as conn:
        claimant = worker + roles.LEASE_ONLY
        return roles.claim_inbox(conn, service.tables, claimant, 10, LEASE, **caps)


def _finish(service: Service, claimed: list[Any]) -> None:
    with service.engine.begin() as conn:
        roles.mark_processed(conn, service.tables, [r["id"] for r in claimed])


def _select(service: Service, sql: str) -> list[Any]:
    schema = "outbox_inbox." if service.engine.dialect.name == "postgresql" else ""
    sql = sql.replace("{INBOX}", schema + "inbox_messages")
    with service.engine.connect() as conn:
        sql = sql.replace("{CLAIMS}", schema + "claims_seen")
        return list(conn.execute(text(sql.replace("{COUNTS}", schema + "inbox_rate_counts"))))


def test_a_rate_is_never_exceeded_by_two_workers_on_two_connections(service: Service) -> None:
    handled: list[str] = []
    service.on_command("job.run", rate=(4, HOUR))(lambda message, session: handled.append("x"))
    _store(service, JOB, 20)
    workers = [service.worker(), service.worker()]

    def run(n: int) -> None:  # each worker claims on its own connection, at the same time
        conn = workers[n].connect()
        try:
            for _ in range(15):
                workers[n].work_once(conn)
        finally:
            workers[n].give_back(conn)
            conn.close()
            workers[n].close_liveness()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # 30 claims, each after the last one's rows were processed: 4 within the hour, no more.
    assert len(handled) == 4
    assert _select(
        service, "SELECT status, attempts, count(*) FROM {INBOX} GROUP BY 1, 2 ORDER BY 1"
    ) == [
        ("pending", 0, 16),
        ("processed", 1, 4),
    ]


def test_a_claim_waits_for_the_open_claim_of_a_rate_capped_type_and_counts_its_rows(
    db_url: str,
) -> None:
    service = make_service("billing", db_url, None)
    _store(service, JOB, 6)
    rates = {JOB: (2, HOUR)}
    claimed: list[Any] = []

    def second() -> None:
        claimed.extend(_claim(service, "w-2", rates=rates))

    with service.engine.connect() as conn:
        first = roles.claim_inbox(
            conn, service.tables, "w-1" + roles.LEASE_ONLY, 10, LEASE, rates=rates
        )
        other = threading.Thread(target=second)
        other.start()
        # The second claim runs while the first one's transaction is open: it waits on the
        # type's lock (or, without one, would count none of the first one's rows).
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
        wait_until(lambda: not other.is_alive() or scalar(db_url, waiting) == 1, what="a wait")
        conn.commit()
    other.join(30)
    assert (len(first), claimed) == (2, [])
    service.close()


_RATED_APP = """
import sys, threading
from outbox_inbox import Service

db_url = sys.argv[1]
stop = threading.Event()
threads = []
for instance in range(2):
    service = Service("billing", db_url=db_url, mq_url=None, worker_batch_size=3,
                      worker_poll_interval=0.05)
    service.on_command("job.run", rate=(5, 3600.0))(lambda message, session: None)
    service.on_command("mail.send")(lambda message, session: None)
    thread = threading.Thread(target=service.worker().run, args=(stop,))
    thread.start()
    threads.append(thread)
sys.stdin.read()  # until the test closes it
stop.set()
for thread in threads:
    thread.join(30)
"""


def test_a_rate_is_never_exceeded_by_two_processes_of_two_instances(
    db_url: str, tmp_path: Path
) -> None:
    service = make_service("billing", db_url, None)
    _store(service, JOB, 30)
    app = tmp_path / "rated_app.py"
    app.write_text(textwrap.dedent(_RATED_APP))
    children = [
        subprocess.Popen([sys.executable, str(app), db_url], stdin=subprocess.PIPE)
        for _ in range(2)
    ]
    done = f"SELECT count(*) FROM {INBOX} WHERE status = 'processed' AND routing_key = :rk"
    try:
        wait_until(lambda: scalar(db_url, done, rk=JOB) == 5, timeout=60, what="5 jobs")
        # Work of another type stored after them is claimed by the same workers, which claim
        # on: the jobs held back stay held back meanwhile.
        _store(service, "billing.mail.send", 40)
        mail = "billing.mail.send"
        wait_until(lambda: scalar(db_url, done, rk=mail) == 40, timeout=60, what="all mail")
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            child.wait(60)
    assert scalar(db_url, done, rk=JOB) == 5
    assert scalar(db_url, f"SELECT max(attempts) FROM {INBOX} WHERE status = 'pending'") == 0
    service.close()


def test_a_message_held_back_by_a_rate_is_neither_leased_nor_counted(service: Service) -> None:
    _store(service, JOB, 3)
    rates = {JOB: (2, HOUR)}
    first = _claim(service, "w-1", rates=rates)
    assert len(first) == 2
    _finish(service, first)  # a claim counts for the period, finished or not
    assert _claim(service, "w-2", rates=rates) == []
    held = ",".join(str(r["id"]) for r in first)
    sql = "SELECT attempts, locked_by, locked_until FROM {INBOX} WHERE id NOT IN (" + held + ")"
    assert _select(service, sql) == [(0, None, None)]
    # A larger rate allows the place at once (the rate is the worker's, not stored).
    assert len(_claim(service, "w-2", rates={JOB: (3, HOUR)})) == 1


def test_a_held_back_message_is_claimed_by_a_running_worker_once_the_window_passes(
    service: Service,
) -> None:
    service.on_command("job.run", rate=(1, 1.0))(lambda message, session: None)
    _store(service, JOB, 3)
    _note_claims(service)
    stop = threading.Event()
    worker = threading.Thread(target=service.worker().run, args=(stop,))
    worker.start()
    try:  # no new message arrives: the worker comes back for the held rows by itself
        done = "SELECT count(*) FROM {INBOX} WHERE status = 'processed'"
        wait_until(lambda: _select(service, done)[0][0] == 3, timeout=60, what="3 handled")
    finally:
        stop.set()
        worker.join(30)
    # On the database clock the rate counts by: each claim a full period after the last one.
    # (Not the rows' processed_at: each is its processing transaction's start, some
    # milliseconds after its claim, which may take up the margin a claim's tenth leaves.)
    claimed = [r[0] for r in _select(service, "SELECT at FROM {CLAIMS} ORDER BY at")]
    if isinstance(claimed[0], str):  # SQLite's text
        claimed = [datetime.fromisoformat(t) for t in claimed]
    assert len(claimed) == 3
    assert min((b - a).total_seconds() for a, b in pairwise(claimed)) >= 1.0
    assert _select(service, "SELECT max(attempts) FROM {INBOX}") == [(1,)]


def _note_claims(service: Service) -> None:
    """A row of `claims_seen` for each row claimed, at the claim's time on the database clock
    (that of `clock.db_now`: the claim's own)."""
    with service.engine.begin() as conn:
        if service.engine.dialect.name == "sqlite":
            conn.execute(text("CREATE TABLE claims_seen (at TEXT NOT NULL)"))
            conn.execute(
                text(
                    "CREATE TRIGGER note_claim AFTER UPDATE OF attempts ON inbox_messages"
                    " WHEN NEW.attempts > OLD.attempts BEGIN INSERT INTO claims_seen"
                    " VALUES (strftime('%Y-%m-%d %H:%M:%f', 'now')); END"
                )
            )
            return
        conn.execute(text("CREATE TABLE outbox_inbox.claims_seen (at timestamptz NOT NULL)"))
        conn.execute(
            text(
                "CREATE FUNCTION outbox_inbox.note_claim() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN INSERT INTO outbox_inbox.claims_seen VALUES (now()); RETURN NULL; END $$"
            )
        )
        conn.execute(
            text(
                f"CREATE TRIGGER note_claim AFTER UPDATE ON {INBOX} FOR EACH ROW"
                " WHEN (NEW.attempts > OLD.attempts) EXECUTE FUNCTION outbox_inbox.note_claim()"
            )
        )


def test_each_attempt_counts_toward_the_rate_one_waiting_for_its_retry_too(
    service: Service,
) -> None:
    _store(service, JOB, 4)
    rates = {JOB: (3, HOUR)}
    first = _claim(service, "w-1", rates=rates)
    assert len(first) == 3
    with service.engine.begin() as conn:  # one fails and is due again at once
        roles.mark_retry(conn, service.tables, first[0]["id"], "boom", timedelta(0))
    _finish(service, first[1:])
    # Two rows are claimable (the retried one and the fourth): the period has no place left.
    assert _claim(service, "w-2", rates=rates) == []
    assert len(_claim(service, "w-2", rates={JOB: (5, HOUR)})) == 2


def test_the_counts_of_a_rate_keep_only_the_tenths_of_one_period(service: Service) -> None:
    counts = service.tables.rate_counts
    with service.engine.begin() as conn:  # an hour-old tenth, and one of another type
        for key in (JOB, "billing.other.run"):
            conn.execute(counts.insert().values(routing_key=key, bucket=1000, claimed=7))
    _store(service, JOB, 3)
    assert len(_claim(service, "w-1", rates={JOB: (2, 1.0)})) == 2
    rows = "SELECT routing_key, claimed FROM {COUNTS} ORDER BY routing_key"
    assert _select(service, rows) == [("billing.job.run", 2), ("billing.other.run", 7)]


@pytest.mark.parametrize("fair", [True, False])
def test_a_rate_capped_type_does_not_block_another_type(service: Service, fair: bool) -> None:
    _store(service, JOB, 5)
    _store(service, "billing.mail.send", 5)
    rates = {JOB: (1, HOUR)}
    claimed = [r["routing_key"] for r in _claim(service, "w-1", rates=rates, fair=fair)]
    assert sorted(claimed) == [JOB] + ["billing.mail.send"] * 5
    assert _claim(service, "w-2", rates=rates, fair=fair) == []


def test_with_a_rate_and_a_max_concurrency_a_claim_takes_the_fewer_places(
    service: Service,
) -> None:
    _store(service, JOB, 10)
    caps: dict[str, Any] = {"caps": {JOB: 4}, "rates": {JOB: (3, HOUR)}}
    first = _claim(service, "w-1", **caps)  # half of the 4 places, under the rate's 3
    assert len(first) == 2
    _finish(service, first)
    assert len(_claim(service, "w-2", **caps)) == 1  # the rate's last place, under the cap's 2
    assert _claim(service, "w-3", **caps) == []


def test_status_metrics_and_dashboard_show_a_rate_and_that_it_binds(db_url: str) -> None:
    service = make_service("billing", db_url, None)
    service.on_command("job.run", rate=(1, HOUR))(lambda message, session: None)
    service.on_command("mail.send", max_concurrency=3)(lambda message, session: None)
    engine, tables = service.engine, service.tables
    registry = CollectorRegistry()
    instrument(service, registry=registry)
    _store(service, JOB, 2)
    with engine.begin() as conn:  # what a worker of this service advertises
        advertised = service.handlers.advertised()
        roles.advertise_instance(conn, tables, "billing", "i-1", advertised, forget_after=LEASE)

    def shown() -> tuple[Any, ...]:
        report = collect_status(engine, tables, service="billing", admin=None)
        [t] = report["inbox"]["by_type"]
        gauge = registry.get_sample_value(
            "outbox_inbox_inbox_cap_binding", {"service": "billing", "type": JOB}
        )
        return (t["rate"], t["cap"], t["cap_binding"], gauge, cap_shown(t))

    assert shown() == ([1, HOUR], None, False, 0, "1/3600s")
    _finish(service, _claim(service, "w-1", rates=service.handlers.per_key("rate")))
    assert shown() == ([1, HOUR], None, True, 1, "1/3600s binding")
    assert cap_shown({"cap": 3, "rate": [10, 0.5]}) == "3, 10/0.5s"
    assert scalar(db_url, f"SELECT count(*) FROM {INBOX} WHERE attempts = 0") == 1
    service.close()


@pytest.mark.parametrize(
    "rate", [(0, 1.0), (1, 0), (1, -1.0), (True, 1.0), (1, True), (1.5, 1.0), [1, 1.0], (1,)]
)
def test_a_rate_is_an_int_of_at_least_one_per_positive_seconds(rate: Any) -> None:
    service = Service("billing", db_url="sqlite://", mq_url=None)
    with pytest.raises(ConfigurationError, match="rate must be"):
        service.on_command("a.run", rate=rate)(lambda message, session: None)
    with pytest.raises(ConfigurationError, match="rate applies to one routing key"):
        service.on_event("orders.#", rate=(1, 1.0))(lambda message, session: None)
    service.on_command("b.run", rate=(1, 0.5))(lambda message, session: None)


def test_two_handlers_of_one_event_keep_to_both_rates() -> None:
    service = Service("billing", db_url="sqlite://", mq_url=None)
    service.on_event("orders.order.placed", rate=(10, 2.0))(lambda message, session: None)
    service.on_event("orders.order.placed", rate=(6, 1.0))(lambda message, session: None)
    assert service.handlers.per_key("rate") == {"orders.order.placed": (6, 2.0)}
