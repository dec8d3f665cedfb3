"""The dashboard and `outbox-inbox status` against real servers: three services answer in
about the time of one (the broker checks run at once, and the flow-control probe waits for
the broker's answer, not for a timeout), and a service whose rows wait with no worker
claiming them is unhealthy in both, while a running worker keeps it healthy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import cli_app
import pytest
from click.testing import CliRunner
from sqlalchemy import func, text

from helpers import wait_until
from outbox_inbox import Service
from outbox_inbox.brokers.rabbitmq import RabbitMQBroker
from outbox_inbox.brokers.rabbitmq_admin import RabbitMQAdmin
from outbox_inbox.cli.main import main
from outbox_inbox.dashboard import Dashboard, WatchedService
from outbox_inbox.status import collect_status, problems
from outbox_inbox.testing.injection import memory_alarm
from outbox_inbox.testing.servers import RabbitMQServer

NAMES = ("billing", "shipping", "orders")
#: The flow-control probe's timeout in these tests (`long_probe`). The old probe waited its
#: full timeout per service, one service after another: three services would take 60 s. Both
#: pages take about one round trip a service; the limit leaves a busy machine ample room and
#: still fails on a probe that waits for its timeout even once.
PROBE_TIMEOUT = 20.0
THREE_SERVICES_LIMIT = PROBE_TIMEOUT / 2


@pytest.fixture
def long_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every flow-control probe waits up to `PROBE_TIMEOUT` for the broker's answer."""
    probe = RabbitMQAdmin.flow_control
    monkeypatch.setattr(
        RabbitMQAdmin, "flow_control", lambda self, timeout=1.0: probe(self, PROBE_TIMEOUT)
    )


@pytest.fixture
def three(db_url: str, mq_url: str) -> Iterator[list[Service]]:
    """Three services, each in a schema of its own in the test's database."""
    services = [cli_app.build(name, db_url, mq_url, schema=f"s_{name}") for name in NAMES]
    try:
        for service in services:
            cli_app.prepare(service)
            service.declare_topology()  # a missing inbox queue is unhealthy
        yield services
    finally:
        for service in services:
            service.close()


def _watched(service: Service, mq_url: str) -> WatchedService:
    return WatchedService(service.name, service.engine, service.tables, RabbitMQBroker(mq_url))


def _get(app: Dashboard, path: str) -> tuple[str, str]:
    """GET `path` from the WSGI application; (status, body)."""
    replies: list[str] = []
    body = app(
        {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "HTTP_HOST": "127.0.0.1"},
        lambda status, headers: replies.append(status),
    )
    return replies[0], b"".join(body).decode()


@pytest.mark.usefixtures("long_probe")
def test_overview_of_three_services_takes_about_one_service_not_three_seconds(
    three: list[Service], mq_url: str
) -> None:
    app = Dashboard([_watched(s, mq_url) for s in three], audit=lambda **_: None)
    _get(app, "/")  # the engines' first connections
    started = time.monotonic()
    status, body = _get(app, "/")
    took = time.monotonic() - started
    assert status == "200 OK"
    assert body.count('class="badge healthy"') == 3, body
    assert took < THREE_SERVICES_LIMIT, f"the overview of three services took {took:.2f}s"


@pytest.mark.usefixtures("long_probe")
def test_status_of_three_services_takes_well_under_the_old_second_each(
    three: list[Service], db_url: str, mq_url: str
) -> None:
    runner = CliRunner()
    args = ["status", "--db-url", db_url, "--mq-url", mq_url, "--json"]
    started = time.monotonic()
    for name in NAMES:
        result = runner.invoke(main, [*args, "--service", name, "--schema", f"s_{name}"])
        assert result.exit_code == 0, result.output
        assert '"blocked": null' in result.output
    took = time.monotonic() - started
    assert took < THREE_SERVICES_LIMIT, f"status of three services took {took:.2f}s"


def test_flow_control_still_sees_a_memory_alarm_and_answers_at_once_without_one(
    local_rabbitmq_server: RabbitMQServer, mq_url: str
) -> None:
    with RabbitMQBroker(mq_url).operator() as admin:
        started = time.monotonic()
        assert admin.flow_control(timeout=PROBE_TIMEOUT) is None
        # the broker's answer, not the timeout
        assert time.monotonic() - started < THREE_SERVICES_LIMIT
        with memory_alarm(local_rabbitmq_server):
            assert "memory" in (admin.flow_control(timeout=5.0) or "")


def _insert_pending(service: Service, count: int, **values: Any) -> None:
    """`count` inbox rows, pending, that became due 10 minutes ago (received then)."""
    ago = func.now() - text("interval '10 minutes'")
    with service.engine.begin() as conn:
        for _ in range(count):
            conn.execute(
                service.tables.inbox.insert().values(
                    message_id=uuid.uuid4(),
                    kind="command",
                    routing_key="billing.invoice.create",
                    payload={},
                    headers={},
                    **{"received_at": ago, "next_attempt_at": ago, **values},
                )
            )


def test_rows_waiting_with_no_worker_are_unhealthy_and_a_running_worker_makes_it_healthy(
    db_url: str, mq_url: str
) -> None:
    service = cli_app.build("billing", db_url, mq_url)
    cli_app.prepare(service)
    app = Dashboard([_watched(service, mq_url)], audit=lambda **_: None)
    try:
        # Rows held behind a key's failed head, due only in 5 minutes, need no worker now.
        _insert_pending(
            service, 1, key="k", finished=1, next_attempt_at=func.now() + text("interval '5m'")
        )
        _insert_pending(service, 3, key="k")
        status = collect_status(service.engine, service.tables, service="billing", admin=None)
        assert status["inbox"]["claimable"] == 0
        assert problems(status) == []

        _insert_pending(service, 24)
        status = collect_status(service.engine, service.tables, service="billing", admin=None)
        assert status["inbox"]["claimable"] == 24
        (stalled,) = problems(status)
        assert stalled.startswith("inbox stalled: 24 row(s) claimable for up to 6")
        assert "no worker has claimed for over 60s" in stalled
        # Within the lag bound given, the same rows are lag first, and stalled too.
        found = problems(status, max_lag=120)
        assert any("inbox lag" in p for p in found)
        assert any("no worker has claimed for over 120s" in p for p in found)
        _, page = _get(app, "/")
        assert page.count('class="badge unhealthy"') == 1 and "inbox stalled" in page

        service.start()
        try:
            wait_until(
                lambda: (
                    not problems(
                        collect_status(
                            service.engine, service.tables, service="billing", admin=None
                        )
                    )
                ),
                what="the worker to claim the waiting rows",
            )
            _, page = _get(app, "/")
            assert 'class="badge healthy"' in page and "inbox stalled" not in page
        finally:
            service.stop()
    finally:
        service.close()
