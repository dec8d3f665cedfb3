"""Every server fault is recovered from in seconds, with nothing lost and nothing doubled.

Each test runs two services against the session's private servers: ``orders`` commits 2,400
messages at 150 a second (half commands to billing, half events billing subscribes to) and runs
a relay process; ``billing`` runs a receiver process and a worker process. All three roles use
the library's default settings. Once messages flow end to end, the test injects one fault:

1. RabbitMQ SIGKILLed and started again;
2. PostgreSQL stopped in immediate mode (``pg_ctl stop -m immediate``: no checkpoint, crash
   recovery at the next start), down for a few seconds, and started again;
3. ``pg_terminate_backend`` of every session of the two service databases, five times over
   (and no role logs a traceback or a crash for it);
4. RabbitMQ's memory alarm, then its disk alarm (its free-disk limit set far above the free
   space), for 5 s each (every publishing connection blocked; one warning per role at most);
5. the broker's port blackholed on loopback with iptables for 10 s (packets dropped: the
   connections hang, nothing is closed).

Then each asserts that every message committed before the fault (before it was in force:
the server gone, the alarm on, the rules in place) was handled within 15 s of the fault being
over (the server answering again, or the fault removed), and so was every message committed
while it lasted (waiting in orders' outbox, or in the broker); once the writer is done, that
every committed message has exactly one effect at billing, each inbox row was handled once and
nothing is dead. For the broker's faults it also asserts that the business transactions never
failed and that the fault really held the flow up. The measured times are printed at the end of
the session, passed or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.testing.injection import (
    Alarm,
    blackhole,
    disk_alarm,
    memory_alarm,
    stop_postgres_immediately,
    terminate_backends,
)
from servers import PostgresHandle, PostgresServer, RabbitMQServer

from .flow import Recovery, TwoServices

pytestmark = pytest.mark.faults

#: How long PostgreSQL stays down, the memory alarm lasts, the port stays blackholed.
POSTGRES_DOWN = 3.0
ALARM = 5.0
#: How many rounds of pg_terminate_backend the session test gives.
TERMINATES = 5
BLACKHOLE = 10.0

#: The `record_recovery` fixture (conftest.py): record(case, figures, outcome).
RecordRecovery = Callable[[str, dict[str, Any], str], None]


def _conclude(result: Recovery, record: RecordRecovery, broker_fault: bool = False) -> None:
    """Record the figures, then fail with every problem found."""
    problems = list(result.problems)
    if broker_fault:
        # Business transactions need only the database (docs/runbook.md, "When RabbitMQ is
        # down"); and the fault really stopped the flow: messages committed while it lasted
        # could not reach billing before it was over.
        if result.writer_failed_commits:
            problems.append(
                f"{result.writer_failed_commits} business transactions failed during a broker "
                f"fault, which needs only the database: {result.extra.get('writer_errors')}"
            )
        if result.during_fault == 0 or result.handled_during_fault > result.during_fault // 2:
            problems.append(
                f"the fault did not stop the flow: {result.handled_during_fault} of the "
                f"{result.during_fault} messages committed during it were handled before its end"
            )
    record(result.case, result.figures(), "failed" if problems else "passed")
    assert not problems, "\n".join(problems)


def _finish(flow: TwoServices, case: str) -> Recovery:
    result = flow.finish(case)
    assert flow.writer is not None
    if flow.writer.errors:
        result.extra["writer_errors"] = flow.writer.errors[:3]
    return result


def test_rabbitmq_sigkill_and_restart_recovers_within_15s(
    two_services: TwoServices,
    local_rabbitmq_server: RabbitMQServer,
    record_recovery: RecordRecovery,
) -> None:
    flow = two_services
    flow.start()
    # Vhost, queues and bindings on disk before the crash (see RabbitMQServer.flush_metadata).
    local_rabbitmq_server.flush_metadata()
    try:
        local_rabbitmq_server.kill()
        flow.fault_begins()
        local_rabbitmq_server.start()
    finally:
        if not local_rabbitmq_server.running:
            local_rabbitmq_server.start()
    flow.fault_over()
    _conclude(_finish(flow, "rabbitmq-sigkill"), record_recovery, broker_fault=True)


def test_postgres_immediate_stop_and_restart_recovers_within_15s(
    two_services: TwoServices,
    local_postgres_server: PostgresServer,
    record_recovery: RecordRecovery,
) -> None:
    flow = two_services
    flow.start()
    try:
        stop_postgres_immediately(local_postgres_server)
        flow.fault_begins()
        time.sleep(POSTGRES_DOWN)
        local_postgres_server.start()
    finally:
        if not local_postgres_server.running:
            local_postgres_server.start()
    flow.fault_over()
    result = _finish(flow, "postgres-immediate-stop")
    result.extra["postgres_down_s"] = POSTGRES_DOWN
    _conclude(result, record_recovery)


def test_every_service_database_session_terminated_five_times_recovers_within_15s_quietly(
    two_services: TwoServices,
    postgres_server: PostgresHandle,
    record_recovery: RecordRecovery,
) -> None:
    flow = two_services
    flow.start()
    flow.fault_begins()
    terminated: list[Any] = []
    for _ in range(TERMINATES):
        terminated += terminate_backends(postgres_server, flow.databases)
        time.sleep(1.0)  # the roles reconnect in between: each round cuts new sessions
    flow.fault_over()
    result = _finish(flow, "pg-terminate-backend")
    result.extra["terminated_sessions"] = sum(1 for row in terminated if row[3])
    # The relay, the receiver and the worker each had sessions there (LISTEN ones included).
    if result.extra["terminated_sessions"] < 3 * TERMINATES:
        result.problems.append(f"too few sessions terminated to hit every role: {terminated}")
    # An outage is not a crash: at the default level (INFO) no role logs a traceback or a
    # restart for a session the server ended, whichever layer of the driver raised it.
    for process in flow.processes.started:
        text = process.log_path.read_text(errors="replace")
        noisy = [line for line in text.splitlines() if "Traceback" in line or "crashed" in line]
        if noisy:
            result.problems.append(f"{process.name} logged {noisy[:3]}:\n{process.log_tail()}")
    _conclude(result, record_recovery)


@pytest.mark.parametrize("alarm", [memory_alarm, disk_alarm], ids=["memory", "disk"])
def test_rabbitmq_alarm_for_5s_blocks_publishers_with_one_warning_and_recovers_within_15s(
    two_services: TwoServices,
    local_rabbitmq_server: RabbitMQServer,
    record_recovery: RecordRecovery,
    alarm: Callable[[RabbitMQServer], AbstractContextManager[Alarm]],
) -> None:
    flow = two_services
    flow.start()
    logs = flow.log_sizes()
    kind = "memory" if alarm is memory_alarm else "disk"
    with alarm(local_rabbitmq_server) as raised:
        flow.fault_begins()
        started = time.monotonic()
        # The flow control is visible: `outbox-inbox status` asks the broker the same way.
        with RabbitMQBroker(flow.mq_url).operator() as admin:
            assert kind in (admin.flow_control(timeout=3.0) or "")
        time.sleep(max(0.0, ALARM - (time.monotonic() - started)))
    flow.fault_over()
    with RabbitMQBroker(flow.mq_url).operator() as admin:
        assert admin.flow_control(timeout=1.0) is None
    result = _finish(flow, f"rabbitmq-{kind}-alarm")
    result.extra.update(
        alarm_s=ALARM,
        alarm_raised_s=round(raised.raised_s, 2),
        alarm_cleared_s=raised.cleared_s and round(raised.cleared_s, 2),
    )
    flow.warned_more_than_once(logs, result)
    _conclude(result, record_recovery, broker_fault=True)


def test_broker_port_blackholed_for_10s_recovers_within_15s(
    two_services: TwoServices,
    local_rabbitmq_server: RabbitMQServer,
    iptables: str,
    record_recovery: RecordRecovery,
) -> None:
    flow = two_services
    flow.start()
    with blackhole(iptables, local_rabbitmq_server.port):
        flow.fault_begins()
        time.sleep(BLACKHOLE)
    flow.fault_over()
    result = _finish(flow, "rabbitmq-blackhole")
    result.extra["blackhole_s"] = BLACKHOLE
    _conclude(result, record_recovery, broker_fault=True)
