"""Fixtures of the fault-injection tests, and the table of recovery times printed at the end.

The service fixtures are those of the end-to-end tests (tests/e2e/conftest.py), shared as they
are; the servers are the session's (tests/conftest.py). Each test records its figures with
`record_recovery`: they go to the test's junit properties, to its captured output, and to a
table printed once at the end of the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

# The e2e fixtures, and its hook that attaches the role processes' logs to a failed test.
from e2e.conftest import (  # noqa: F401
    make_service,
    prepare_db,
    processes,
    pytest_runtest_makereport,
)
from e2e.harness import Database, Processes, make_synchronous
from model.conformance import conforming

from outbox_inbox import Service
from outbox_inbox.testing.injection import StreamingReplica, iptables_problem
from servers import PostgresServer

from .flow import RECOVERY_BOUND, TwoServices
from .replay import REPLAYED

_RECORDED: list[dict[str, Any]] = []


@pytest.fixture
def two_services(
    db_url: str,
    db_url_factory: Callable[[], str],
    mq_url: str,
    make_service: Callable[..., Service],  # noqa: F811
    prepare_db: Callable[[str, str], Database],  # noqa: F811
    processes: Processes,  # noqa: F811
) -> Iterator[TwoServices]:
    """orders and billing on databases of their own, not started yet (`start()`)."""
    flow = TwoServices(
        orders_url=db_url,
        billing_url=db_url_factory(),
        mq_url=mq_url,
        make_service=make_service,
        prepare_db=prepare_db,
        processes=processes,
    )
    try:
        yield flow
    finally:
        flow.stop_writer()


@pytest.fixture
def failover_pair(
    local_postgres_server: PostgresServer,
) -> Iterator[tuple[PostgresServer, StreamingReplica]]:
    """A primary of this test's own and its synchronous streaming replica, both running.

    Not the session's server (`local_postgres_server` is asked for its skip alone: a local
    server is needed): a failover leaves the primary stopped for good. Commits wait for the
    replica's flush (``synchronous_standby_names``, ``synchronous_commit = on``): a commit
    that returned survives the failover (docs/failures.md). Both are removed afterwards."""
    primary = PostgresServer()
    replica = StreamingReplica(primary)
    try:
        primary.start()
        replica.start()
        make_synchronous(replica)
        yield primary, replica
    finally:
        try:
            replica.cleanup()
        finally:
            primary.cleanup()


@pytest.fixture
def record_recovery(
    request: pytest.FixtureRequest, record_property: Callable[[str, object], None]
) -> Callable[[str, dict[str, Any], str], None]:
    """record(case, figures, outcome): keep one fault's figures for the end-of-session table."""

    def record(case: str, figures: dict[str, Any], outcome: str) -> None:
        row = {"case": case, "test": request.node.name, "outcome": outcome, **figures}
        _RECORDED.append(row)
        for key, value in row.items():
            record_property(key, value)
        print(f"fault recovery {row}", flush=True)

    return record


@pytest.fixture(scope="session")
def iptables() -> str:
    """Path of an iptables that can add and delete rules here (installed with apt-get when
    missing and we are root); skips the test otherwise."""
    path, why_not = iptables_problem()
    if path is None:
        pytest.skip(f"no blackhole without iptables: {why_not}")
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _replayed_summary(terminalreporter)
    if not _RECORDED:
        return
    terminalreporter.write_sep(
        "-", f"fault recovery, seconds after the fault was over (bound {RECOVERY_BOUND:.0f} s)"
    )
    header = (
        f"{'case':<24} {'outcome':<7} {'fault':>6} {'pre-fault':>9} {'fault':>6} {'all':>6}"
        f" {'msgs':>5} {'during':>6} {'lost':>4} {'dup':>3} {'wfail':>5} {'retry':>5}"
    )
    terminalreporter.write_line(header)

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for row in _RECORDED:
        terminalreporter.write_line(
            f"{row['case']:<24} {row['outcome']:<7} {secs(row['fault_s']):>6}"
            f" {secs(row['recovered_s']):>9} {secs(row['caught_up_s']):>6}"
            f" {secs(row['drained_s']):>6} {row['total']:>5} {row['during_fault']:>6}"
            f" {row['lost']:>4}"
            f" {row['duplicates']:>3} {row['writer_failed_commits']:>5}"
            f" {row['retried_publishes']:>5}"
        )
    terminalreporter.write_line(
        "fault: from the fault in force to its end; pre-fault: every message committed before"
        " it handled; fault: every one committed until its end handled; all: every message"
        " handled; during: messages committed during the fault; wfail: writer commits that"
        " failed; retry: outbox rows whose publish failed at least once"
    )


def _replayed_summary(terminalreporter: Any) -> None:
    """The runs replayed against the model (replay.py): a run with no fault is not counted,
    nor a buggy service's (its test expects it rejected)."""
    if not REPLAYED:
        return
    counted, conform = conforming(REPLAYED)
    terminalreporter.write_sep(
        "-",
        f"fault runs replayed against the model: {conform} of {counted} conform"
        f" ({len(REPLAYED) - counted} not counted: no fault, or a buggy service's)",
    )
    for r in REPLAYED:
        premises = ", ".join(f"{k} {v}" for k, v in sorted(r.premises.items()) if v)
        verdict = "conforms" if r.conforms else f"{len(r.violations)} violations"
        note = " (buggy)" if r.broken else "" if r.counts else " (no fault)"
        terminalreporter.write_line(
            f"{r.run + note:<46} {verdict:<14} {r.messages:>5} msgs {r.events:>6} events;"
            f" {premises}"
        )
