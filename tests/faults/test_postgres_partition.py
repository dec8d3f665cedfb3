"""A partition between the roles and PostgreSQL, RabbitMQ reachable: an outage, then the flow.

The flow of tests/faults/flow.py (orders' writer and relay, billing's receiver and worker, the
library's defaults) runs, orders on a PostgreSQL server of the test's own and billing on the
session's; then the session's PostgreSQL port is blackholed on loopback with iptables for
`PARTITION` seconds: every packet to and from it is dropped, so a connection hangs instead of
failing, and a new one gets no answer. orders goes on writing and relaying, and RabbitMQ stays
reachable, so billing's receiver keeps being offered deliveries it cannot store.

The test asserts what the flow asserts (every committed message handled once, within 15 s of
the partition's end), and what the receiver must not do meanwhile: hold more than its
prefetch, take the deliveries again and again (a redelivery storm would count every message
toward `max_redeliveries` and the queue's delivery limit, and dead-letter good messages), or
move them through the delay tiers; and that no role died or logged a traceback.

A second test times the client-side bounds themselves on the library's engine: a statement
sent into a partition, a checkout whose pooled connection must be pinged (10.5 s and 15.5 s
measured; without the bounds the statement outlived the test's 90 s timeout).

The probes of the flow talk to the blackholed port too: none runs while the partition holds
(the broker's figures come from RabbitMQ's management API, which gathers them every 5 s: a
sample may be that old).

Measured with the library's defaults: the worker meets the outage 11 s into the partition,
the receiver 15.5 s (`<role>_noticed_s`); everything committed until the partition's end is
handled 3.2-8.7 s after it (six runs on a shared 2-core machine). Red runs: without the
client-side bounds (`CLIENT_BOUNDS`) the receiver's insert hung until 24 s after the
partition and the last messages were handled 28.8 s after it; with the bounds and the
receiver of before (it consumed again after a failed insert), the receiver held 500
deliveries again at the partition's end and had sent some round the delay tiers; before the
worker set `tcp_user_timeout` on its session (`roles.limit_worker`), one run took
24 s: the partition caught a batch while the server was answering, and the batch's row locks
outlived the partition.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pytest
from e2e.harness import Database, Processes
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from outbox_inbox import Service
from outbox_inbox.config import Settings
from outbox_inbox.database import PING_AFTER, connect
from outbox_inbox.errors import database_unreachable
from outbox_inbox.testing.injection import blackhole
from outbox_inbox.topology import delay_queue
from servers import PostgresServer, RabbitMQServer

from .flow import TwoServices
from .test_server_faults import RecordRecovery, _conclude, _finish

pytestmark = pytest.mark.faults

#: How long the partition holds: twice the library's client-side bound on a call that gets no
#: answer (database.CLIENT_BOUNDS: 15 s at most), so that every role meets the outage.
PARTITION = 30.0
#: The receiver's prefetch with the library's defaults.
PREFETCH = Settings().prefetch


@pytest.fixture
def orders_apart(
    local_postgres_server: PostgresServer,
    mq_url: str,
    db_url_factory: Callable[[], str],
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> Iterator[TwoServices]:
    """`two_services` with orders' database on a server of its own, which the partition of the
    session's server (billing's) does not reach. (`local_postgres_server` is asked for its
    skip: the partition needs a local server.)"""
    server = PostgresServer()
    flow: TwoServices | None = None
    try:
        server.start()
        server.create_database("orders")
        flow = TwoServices(
            orders_url=server.url("orders"),
            billing_url=db_url_factory(),
            mq_url=mq_url,
            make_service=make_service,
            prepare_db=prepare_db,
            processes=processes,
        )
        yield flow
    finally:
        if flow is not None:
            flow.stop_writer()
        processes.kill_all()  # before the server goes: the relay is connected to it
        server.cleanup()


def _queue(server: RabbitMQServer, mq_url: str, name: str) -> dict[str, Any]:
    """The management API's view of queue `name` in the vhost of `mq_url`."""
    assert server.management_url is not None, "the session's RabbitMQ runs without management"
    vhost = unquote(urlsplit(mq_url).path[1:]) or "/"
    parts = urlsplit(server.management_url)
    request = urllib.request.Request(
        f"{parts.scheme}://{parts.hostname}:{parts.port}"
        f"/api/queues/{quote(vhost, safe='')}/{quote(name, safe='')}"
    )
    token = base64.b64encode(f"{parts.username}:{parts.password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return dict(json.load(response))


def _noticed(log: str, since: float) -> float | None:
    """Seconds from `since` (epoch) to a role's first outage warning in `log` (the log lines
    start with the local time: ``2026-11-26 12:40:07,324``), or None if it logged none."""
    for line in log.splitlines():
        if "unavailable" in line and "retrying every" in line:
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= since:
                return round(at - since, 1)
    return None


def test_a_30s_partition_from_postgres_is_an_outage_the_receiver_waits_out_without_a_storm(
    orders_apart: TwoServices,
    local_postgres_server: PostgresServer,
    local_rabbitmq_server: RabbitMQServer,
    iptables: str,
    record_recovery: RecordRecovery,
) -> None:
    flow = orders_apart
    assert "127.0.0.1" in flow.billing_url, "over a Unix socket the rules would do nothing"
    flow.start()
    samples: list[tuple[float, int, int]] = []  # (seconds in, unacknowledged, consumers)
    with blackhole(iptables, local_postgres_server.port):
        flow.fault_begins()
        started, began_at = time.monotonic(), time.time()
        while (elapsed := time.monotonic() - started) < PARTITION:
            inbox = _queue(local_rabbitmq_server, flow.mq_url, "billing.inbox")
            # (A figure the API has not gathered yet is missing from its answer.)
            unacked, consumers = inbox.get("messages_unacknowledged", 0), inbox.get("consumers", 0)
            samples.append((round(elapsed, 1), unacked, consumers))
            time.sleep(max(0.0, min(1.0, PARTITION - (time.monotonic() - started))))
    flow.fault_over()
    result = _finish(flow, "postgres-partition")
    result.extra["partition_s"] = PARTITION
    result.extra["unacked_samples"] = samples
    problems = result.problems

    # The receiver never held more than its prefetch, and it gave back what it held and
    # stopped consuming once it met the outage (within the client-side bound).
    most = max(unacked for _, unacked, _ in samples)
    if most > PREFETCH:
        problems.append(f"{most} deliveries unacknowledged at once, over the prefetch {PREFETCH}")
    late = [s for s in samples if s[0] >= PARTITION - 3]
    if any(unacked or consumers for _, unacked, consumers in late):
        problems.append(f"the receiver still consumed at the partition's end: {late}")

    # Each message was given back at most once, and none went round the delay tiers.
    inbox = _queue(local_rabbitmq_server, flow.mq_url, "billing.inbox")
    redelivered = inbox.get("message_stats", {}).get("redeliver", 0)
    result.extra["redelivered"] = redelivered
    if redelivered > PREFETCH:
        problems.append(f"{redelivered} redeliveries from billing.inbox: more than one prefetch")
    assert flow.billing_db is not None
    counted = flow.billing_db.scalar(
        "SELECT coalesce(max(deliveries), 0) FROM outbox_inbox.inbox_deliveries"
    )
    result.extra["most_deliveries"] = counted
    if counted > 1:
        problems.append(f"a message was redelivered {counted} times (inbox_deliveries)")
    delayed = {
        tier: _queue(local_rabbitmq_server, flow.mq_url, delay_queue("billing", tier))
        .get("message_stats", {})
        .get("publish", 0)
        for tier in Settings().delay_tiers
    }
    if any(delayed.values()):
        problems.append(f"messages sent to the delay tiers during an outage: {delayed}")

    # An outage is not a crash: every role ran through it, and none logged a traceback.
    for process in flow.processes.started:
        text = process.log_path.read_text(errors="replace")
        result.extra[f"{process.name}_noticed_s"] = _noticed(text, began_at)
        noisy = [line for line in text.splitlines() if "Traceback" in line or "crashed" in line]
        if noisy or not process.alive():
            problems.append(f"{process.name} logged {noisy[:3]}:\n{process.log_tail()}")
    _conclude(result, record_recovery)


@pytest.mark.timeout(90)  # without the bounds each call would hang for minutes
def test_calls_into_a_partition_fail_within_the_client_side_bounds(
    db_url: str, local_postgres_server: PostgresServer, iptables: str
) -> None:
    """The library's engine (`database.connect`, the defaults), each case in a partition of its
    own: a statement on a connection in hand fails after `tcp_user_timeout` (10 s); a checkout,
    early in the partition, of a pooled connection idle past `database.PING_AFTER` after its
    ping (10 s) and a new connection (`connect_timeout`, 5 s), 15 s in all. (A connection idle
    longer in the partition is found dead by its keepalives, 10 s in: its ping then fails at
    once.) Both are an outage (`errors.database_unreachable`)."""
    engine = connect(db_url).engine
    took: dict[str, float] = {}
    try:
        for case in ("statement", "checkout"):
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))  # the pool holds a live connection
            conn = engine.connect()
            if case == "checkout":
                conn.close()  # back to the pool
            with blackhole(iptables, local_postgres_server.port):
                if case == "checkout":
                    time.sleep(PING_AFTER + 0.2)  # idle past PING_AFTER: the checkout pings it
                started = time.monotonic()
                with pytest.raises(OperationalError) as caught:
                    if case == "statement":
                        conn.execute(text("SELECT 1"))
                    else:
                        engine.connect().close()
                took[case] = round(time.monotonic() - started, 1)
            assert database_unreachable(caught.value), caught.value
        print(f"client-side bounds: failed after {took}", flush=True)
        assert 9 <= took["statement"] <= 13 and 13 <= took["checkout"] <= 18, took
    finally:
        engine.dispose()
