"""A PostgreSQL failover to a streaming replica loses nothing and is recovered from in seconds.

Each test runs the flow of test_server_faults.py (orders: writer and relay; billing: receiver and
worker; the library's default settings) on a primary of its own with a synchronous streaming
replica (`failover_pair`), through a db_url that names both servers
(``?host=primary:port,replica:port``). Once messages flow, the primary is stopped in immediate
mode, and then:

1. with ``target_session_attrs=read-write``, the replica is promoted (``pg_ctl promote``): the
   roles find it through the host list, every message committed before the failover, and
   until the promotion, is handled within 15 s of it, and so is one committed after it (the
   flow is back: ``flowing_again_s``);
2. with no ``target_session_attrs`` (libpq takes the first server that answers), the roles'
   sessions land on the replica while it is still a standby, where every write fails with
   SQLSTATE 25006 ("cannot execute ... in a read-only transaction"); the primary is then
   started again, and not the replica but it must be found: a read-only session is an outage
   that drops the pool's connections, or the writer and the relay would stay on the standby
   for good (seen so with `errors.read_only_session` broken).

Both assert what the other fault tests assert: 0 messages lost, 0 effects of messages never
committed, 0 duplicate effects (a publish whose mark the failover took is sent again, and the
inbox absorbs it), each inbox row handled once, nothing dead; the recovery time is printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from e2e.harness import Database, Processes, wait_until
from sqlalchemy.exc import SQLAlchemyError

from outbox_inbox import Service
from outbox_inbox.config import validate_db_url
from outbox_inbox.testing.injection import StreamingReplica, stop_postgres_immediately
from servers import PostgresServer

from .flow import RECOVERY_BOUND, TwoServices

pytestmark = pytest.mark.faults

RecordRecovery = Callable[[str, dict[str, Any], str], None]


def _failover_url(
    primary: PostgresServer, replica: PostgresServer, dbname: str, attrs: str | None
) -> str:
    """The db_url of `dbname` naming both servers, as an operator writes it."""
    query = f"host={primary.host}:{primary.port},{replica.host}:{replica.port}"
    if attrs is not None:
        query += f"&target_session_attrs={attrs}"
    return validate_db_url(f"postgresql://{primary.user}@/{dbname}?{query}")


@pytest.fixture
def start_flow(
    failover_pair: tuple[PostgresServer, StreamingReplica],
    mq_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> Iterator[Callable[[str | None], TwoServices]]:
    """start(target_session_attrs): the flow on the failover pair, messages flowing."""
    primary, replica = failover_pair
    flows: list[TwoServices] = []

    def start(attrs: str | None) -> TwoServices:
        for name in ("orders", "billing"):
            primary.create_database(name)
        flow = TwoServices(
            orders_url=_failover_url(primary, replica, "orders", attrs),
            billing_url=_failover_url(primary, replica, "billing", attrs),
            mq_url=mq_url,
            make_service=make_service,
            prepare_db=prepare_db,
            processes=processes,
        )
        flows.append(flow)
        flow.start()
        return flow

    try:
        yield start
    finally:
        for flow in flows:
            flow.stop_writer()


def _conclude(flow: TwoServices, case: str, record: RecordRecovery, **extra: Any) -> None:
    result = flow.finish(case)
    assert flow.writer is not None
    result.extra.update(extra, writer_errors=flow.writer.errors[:3])
    record(case, result.figures(), "failed" if result.problems else "passed")
    assert not result.problems, "\n".join(result.problems)


def test_failover_to_the_promoted_replica_loses_nothing_and_recovers_within_15s(
    failover_pair: tuple[PostgresServer, StreamingReplica],
    start_flow: Callable[[str | None], TwoServices],
    record_recovery: RecordRecovery,
) -> None:
    primary, replica = failover_pair
    flow = start_flow("read-write")
    stop_postgres_immediately(primary)
    flow.fault_begins()
    started = time.monotonic()
    replica.promote()
    promoted = time.monotonic()
    flow.fault_over()
    # The flow itself is back: a message committed after the promotion has been handled.
    assert flow.writer is not None and flow.billing_db is not None
    before = len(flow.writer.committed())
    wait_until(
        lambda: _handled(flow, flow.writer.committed()[before : before + 1]),
        timeout=RECOVERY_BOUND,
        what="a message committed after the promotion to be handled",
    )
    _conclude(
        flow,
        "postgres-failover",
        record_recovery,
        promote_s=round(promoted - started, 2),
        flowing_again_s=round(time.monotonic() - promoted, 2),
    )


def _handled(flow: TwoServices, ids: list[Any]) -> bool:
    """Whether billing has an effect of each of `ids` (False while the probe's pooled
    connections to the old primary are being found dead)."""
    assert flow.billing_db is not None
    sql = "SELECT count(*) FROM effects WHERE message_id = ANY(:ids)"
    try:
        return bool(ids) and flow.billing_db.scalar(sql, ids=ids) == len(ids)
    except SQLAlchemyError:
        return False


def _refused_on_standby(replica: PostgresServer) -> bool:
    """True once the standby has refused a write of the relay (its claim, on orders) and one
    on billing (the worker's), as its log says: their sessions are there."""
    log = replica.log_path.read_text(errors="replace")
    read_only = "in a read-only transaction"
    return any(
        "@orders ERROR:  cannot execute SELECT FOR UPDATE " + read_only in line
        for line in log.splitlines()
    ) and any("@billing ERROR:" in line and read_only in line for line in log.splitlines())


def test_sessions_that_land_on_a_standby_are_dropped_and_find_the_primary_again(
    failover_pair: tuple[PostgresServer, StreamingReplica],
    start_flow: Callable[[str | None], TwoServices],
    record_recovery: RecordRecovery,
) -> None:
    primary, replica = failover_pair
    flow = start_flow(None)
    stop_postgres_immediately(primary)
    flow.fault_begins()
    wait_until(
        lambda: _refused_on_standby(replica),
        timeout=30,
        what="the relay and the worker to be refused on the standby",
    )
    primary.start()
    flow.fault_over()
    _conclude(flow, "standby-in-host-list", record_recovery)
