"""A full disk is an outage: the roles wait with one warning and resume within seconds.

Each test runs the flow of test_server_faults.py (orders: writer and relay; billing: receiver and
worker; the library's default settings) and, once messages flow, takes a server's disk away:

1. PostgreSQL: the two service databases live on a tmpfs tablespace of their own (the WAL stays
   in the server's data directory, so the server itself keeps running), which a ballast file
   fills to the last page for 5 s. Every write that needs a new page fails with SQLSTATE 53100
   ``could not extend file ...: No space left on device``: the writer's business transactions,
   the relay's marks, the receiver's inserts, the worker's claims. The ballast is then deleted;
2. the same with only billing's business table (``effects``, which the handlers write) on the
   tmpfs: the worker claims its rows, and the handlers' inserts fail.

RabbitMQ's disk alarm is test_server_faults.py's alarm test, run with the memory alarm.

Each asserts what the other fault tests assert (0 lost, 0 effects of messages never committed,
0 duplicate effects, each inbox row handled once, nothing dead, every message committed before
the fault and until its end handled within 15 s of its end), and that no role process logged
more than one warning, or a traceback, for the whole fault: a full disk is waited out like a
lost connection, not counted against the messages. For the first, the fault must have failed
the business transactions (the disk really was full).

Seen red: with 53100 not an outage (`errors._TRANSIENT_STATES`), the second test counted a
failed attempt on 434 messages (up to 4 each) and logged 896 warnings; with the claims of such
a batch not given back, 14 messages died ``abandoned`` in 5 s and the rest took over 60 s;
with the receiver's old warning per batch, the first logged 20 warnings; with pika's own line
on ``connection.blocked``, the relay logged 2 for RabbitMQ's disk alarm.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from outbox_inbox.testing.injection import (
    MountRefused,
    SmallDisk,
    disk_full,
    paused,
    tablespace_on_tmpfs,
)
from servers import PostgresServer

from .flow import TwoServices
from .test_server_faults import RecordRecovery, _conclude, _finish

pytestmark = pytest.mark.faults

#: How long the disk stays full, and the disk alarm lasts.
DISK_FULL = 5.0
#: How long the relay and the worker are paused before the disk fills: a backlog for each.
BACKLOG = 1.0
#: The tmpfs of the two service databases: their catalogs take about 8 MB each, the flow's
#: rows a few more.
DISK_MB = 64


@pytest.fixture
def small_disk(
    two_services: TwoServices, local_postgres_server: PostgresServer
) -> Iterator[SmallDisk]:
    """A tablespace on a tmpfs of DISK_MB MB, for the flow's databases or one of its tables.

    Skips the test when no tmpfs can be mounted here (not root, or a container without the
    right to mount). What it holds is dropped with it at the end, after the writer and the
    role processes are stopped."""
    flow = two_services
    try:
        with tablespace_on_tmpfs(local_postgres_server, DISK_MB) as disk:
            try:
                yield disk
            finally:
                flow.stop_writer()
                flow.processes.kill_all()
    except MountRefused as exc:
        pytest.skip(f"no small disk for PostgreSQL: {exc}")


def test_postgres_disk_full_for_5s_is_waited_out_with_one_warning_and_recovers_within_15s(
    two_services: TwoServices,
    small_disk: SmallDisk,
    record_recovery: RecordRecovery,
) -> None:
    flow = two_services
    small_disk.take_databases(flow.databases)
    flow.start()
    logs = flow.log_sizes()
    # The roles keep up with the writer, whose transactions fail once the disk is full: without
    # a backlog they would have nothing to write during the fault. So the worker is paused
    # first (the receiver stores rows it does not handle), then the relay too: when the disk
    # fills, outbox rows wait to be published and marked, and inbox rows to be claimed,
    # handled and marked (the receiver gets the relay's messages to store during the fault).
    relay, worker = (p.pid for p in flow.processes.started if "receiver" not in p.name)
    with contextlib.ExitStack() as fault:
        with paused([worker]):
            time.sleep(BACKLOG)
            with paused([relay]):
                time.sleep(BACKLOG)
                size = fault.enter_context(disk_full(small_disk.path))
        flow.fault_begins()
        time.sleep(DISK_FULL)
    flow.fault_over()
    result = _finish(flow, "postgres-disk-full")
    result.extra.update(disk_full_s=DISK_FULL, ballast_mb=round(size / 2**20, 1))
    errors = result.extra.get("writer_errors") or []
    if not any("No space left on device" in error for error in errors):
        result.problems.append(f"the business transactions did not fail for the disk: {errors}")
    flow.warned_more_than_once(logs, result)
    _conclude(result, record_recovery)


def test_handlers_table_on_a_full_disk_for_5s_is_an_outage_not_a_handler_failure(
    two_services: TwoServices,
    small_disk: SmallDisk,
    record_recovery: RecordRecovery,
) -> None:
    """Only billing's business table (``effects``, which every handler writes) is on the small
    disk: the worker claims its rows, and each handler's insert fails with 53100. No message
    may be counted as failed for it (each inbox row is handled once: ``finished`` 1), nor
    count a claim more (``attempts`` 1: none comes near ``abandoned``), and each worker
    process warns once."""
    flow = two_services
    flow.start()
    small_disk.take_table(flow.databases[1], "effects")
    logs = flow.log_sizes()
    worker = next(p.pid for p in flow.processes.started if "worker" in p.name)
    with contextlib.ExitStack() as fault:
        with paused([worker]):  # inbox rows wait for it when the disk fills
            time.sleep(BACKLOG)
            fault.enter_context(disk_full(small_disk.path))
        flow.fault_begins()
        time.sleep(DISK_FULL)
    flow.fault_over()
    result = _finish(flow, "handlers-table-disk-full")
    result.extra["disk_full_s"] = DISK_FULL
    # Claimed again after each try, a row counted every claim would be a suspect, then
    # abandoned (dead): the claims of a batch the database could not write are given back.
    counted = [state for state in result.extra["inbox_states"] if state[1] != 1]
    if counted:
        result.problems.append(f"inbox rows counted more than one claim: {counted}")
    flow.warned_more_than_once(logs, result)
    _conclude(result, record_recovery)
