"""Prometheus metrics, scraped over real HTTP, against what the database holds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from helpers import make_service, publish_raw, scalar, wait_until
from outbox_inbox import Message, Reject, RetryPolicy, Service
from outbox_inbox.metrics import instrument
from outbox_inbox.status import collect_status

pytestmark = pytest.mark.integration

CLI_DIR = os.path.join(os.path.dirname(__file__), "..", "cli")


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample at `url`: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        body = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def mounted() -> Iterator[Any]:
    """Serve a WSGI app on a free loopback port in a thread: ``serve(app) -> url``."""
    servers = []

    def serve(app: Any) -> str:
        server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/metrics"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _billing(db_url: str, mq_url: str) -> Service:
    """A service whose command ``job.run`` succeeds, rejects or fails as its payload says."""
    # One message per worker transaction: a failure in a batch runs its batch-mates' handlers
    # again (each run is observed), which would make runs differ from claims.
    service = make_service(
        "billing",
        db_url,
        mq_url,
        retry=RetryPolicy(initial=0.05, max_attempts=2),
        worker_batch_size=1,
    )

    @service.on_command("job.run")
    def run(message: Message, session: Any) -> None:
        mode = message.payload["mode"]
        if mode == "reject":
            raise Reject("not today")
        if mode == "fail":
            raise RuntimeError("always fails")

    return service


def _send(service: Service, modes: list[str]) -> list[uuid.UUID]:
    with service.session() as session, session.begin():
        return [
            service.outbox.send(session, "billing", "job.run", {"mode": mode}) for mode in modes
        ]


def _db(db_url: str, sql: str) -> float:
    return float(scalar(db_url, f"SELECT {sql}"))


def test_metrics_count_what_the_database_recorded_and_gauges_match_status(
    db_url: str, mq_url: str, mounted: Any
) -> None:
    registry = CollectorRegistry()
    service = _billing(db_url, mq_url)
    metrics = instrument(service, registry=registry)
    server = metrics.serve(0)
    mounted_url = mounted(metrics.wsgi_app())
    served_url = f"http://127.0.0.1:{server.port}/metrics"
    inbox, outbox = "outbox_inbox.inbox_messages", "outbox_inbox.outbox_messages"
    try:
        # Nothing runs: the backlog waits in the outbox.
        ids = _send(service, ["ok", "ok", "ok", "reject", "reject", "fail"])
        samples = scrape(served_url)
        assert value(samples, "outbox_inbox_state_up", service="billing") == 1
        backlog = value(samples, "outbox_inbox_outbox_backlog", service="billing")
        assert backlog == 6 == _db(db_url, f"count(*) FROM {outbox} WHERE published_at IS NULL")
        age = value(samples, "outbox_inbox_outbox_oldest_age_seconds", service="billing")
        db_age = _db(db_url, f"extract(epoch FROM now() - min(created_at)) FROM {outbox}")
        assert 0 < age <= db_age + 0.001
        assert (
            value(samples, "outbox_inbox_published_total", service="billing", kind="command") == 0
        )

        service.start()
        # billing sends to itself: each of the three dead commands sends billing a fault,
        # handled (logged: no on_fault handler) like any message, and counted as one.
        wait_until(
            lambda: _db(db_url, f"count(*) FROM {inbox} WHERE status <> 'pending'") == 9,
            what="every message processed or dead, and the three faults handled",
        )
        # A copy of a stored message, as a broker redelivery or a sender's retry makes.
        publish_raw(mq_url, "commands", "billing.job.run", b"{}", message_id=str(ids[0]))
        wait_until(
            lambda: _db(db_url, "coalesce(sum(duplicates), 0) FROM outbox_inbox.inbox_deliveries"),
            what="the copy dropped",
        )
        service.stop()

        samples = scrape(served_url)
        assert scrape(mounted_url) == samples  # the mounted app serves the same registry
        s = "billing"
        processed = _db(db_url, f"count(*) FROM {inbox} WHERE status = 'processed'")
        assert value(samples, "outbox_inbox_handled_total", service=s) == processed == 3 + 3
        for reason in ("rejected", "max_attempts"):
            dead = _db(db_url, f"count(*) FROM {inbox} WHERE dead_reason = '{reason}'")
            assert value(samples, "outbox_inbox_dead_total", service=s, reason=reason) == dead
        assert value(samples, "outbox_inbox_dead_total", service=s, reason="rejected") == 2
        assert value(samples, "outbox_inbox_dead_total", service=s, reason="max_attempts") == 1
        assert value(samples, "outbox_inbox_retried_total", service=s) == 1
        published = _db(db_url, f"count(*) FROM {outbox} WHERE published_at IS NOT NULL")
        assert (
            value(samples, "outbox_inbox_published_total", service=s, kind="command")
            == published
            == 6 + 3
        )
        assert value(samples, "outbox_inbox_received_total", service=s) == _db(
            db_url, f"count(*) FROM {inbox}"
        )
        assert value(samples, "outbox_inbox_duplicates_total", service=s) == _db(
            db_url, "sum(duplicates) FROM outbox_inbox.inbox_deliveries"
        )
        # Handler runs: one per processed or rejected message, two for the one that failed,
        # one per fault.
        runs = _db(db_url, f"sum(attempts) FROM {inbox}")
        assert value(samples, "outbox_inbox_handler_duration_seconds_count", service=s) == runs
        assert runs == 7 + 3
        assert value(samples, "outbox_inbox_publish_lag_seconds_count", service=s) == 6 + 3
        assert value(samples, "outbox_inbox_receive_lag_seconds_count", service=s) == 6 + 3
        assert value(samples, "outbox_inbox_handle_lag_seconds_count", service=s) == 3 + 3
        assert value(samples, "outbox_inbox_publish_lag_seconds_sum", service=s) > 0

        # The gauges are the numbers `outbox-inbox status` shows.
        status = collect_status(service.engine, service.tables, service="billing", admin=None)
        gauges = {
            "outbox_inbox_outbox_backlog": status["outbox"]["unpublished"],
            "outbox_inbox_outbox_dead": status["outbox"]["dead"],
            "outbox_inbox_inbox_pending": status["inbox"]["pending"],
            "outbox_inbox_inbox_in_progress": status["inbox"]["in_progress"],
            "outbox_inbox_inbox_dead": status["inbox"]["dead"],
        }
        for name, expected in gauges.items():
            assert value(samples, name, service=s) == expected, name
        assert value(samples, "outbox_inbox_inbox_dead", service=s) == 3
        assert value(samples, "outbox_inbox_inbox_oldest_pending_age_seconds", service=s) == 0
    finally:
        service.stop()
        server.close()
        service.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_run_serves_metrics_on_loopback_until_sigterm(db_url: str, mq_url: str) -> None:
    """`run all` with two worker processes: what the workers count reaches the metrics that
    the parent process serves."""
    sys.path.insert(0, CLI_DIR)
    try:
        import cli_app
    finally:
        sys.path.remove(CLI_DIR)
    writer = cli_app.build("billing", db_url, mq_url)
    cli_app.prepare(writer)
    with writer.session() as session, session.begin():
        for n in range(4):
            writer.outbox.send(session, "billing", "invoice.create", {"n": n})
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [CLI_DIR, os.environ.get("PYTHONPATH")])),
        cli_app.DB_ENV: db_url,
        cli_app.MQ_ENV: mq_url,
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox_inbox.cli.main",
            "run",
            "all",
            "--app",
            "cli_app:billing",
            "--metrics-port",
            str(port),
            "--processes",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:

        def handled() -> dict[Any, float] | None:
            try:
                samples = scrape(url)
            except OSError:
                return None
            done = value(samples, "outbox_inbox_handled_total", service="billing") == 4
            return samples if done else None

        samples = wait_until(handled, timeout=60, what="4 messages handled, seen by a scrape")
        effects = _db(db_url, "count(*) FROM effects")
        assert value(samples, "outbox_inbox_handled_total", service="billing") == effects == 4
        handlers = "outbox_inbox_handler_duration_seconds_count"
        assert value(samples, handlers, service="billing") == 4
        assert value(samples, "outbox_inbox_state_up", service="billing") == 1
        assert value(samples, "outbox_inbox_outbox_backlog", service="billing") == _db(
            db_url, "count(*) FROM outbox_inbox.outbox_messages WHERE published_at IS NULL"
        )
        # Bound to loopback only, by default.
        listening = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=False
        ).stdout
        if listening.strip():  # where `ss` is present: the local address of each socket
            local = {line.split()[3] for line in listening.splitlines()}
            assert local == {f"127.0.0.1:{port}"}, listening
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    writer.close()


def test_run_with_a_metrics_port_in_use_exits_with_one_line() -> None:
    db_url = "postgresql+psycopg://user:secret@127.0.0.1:1/none"
    mq_url = "amqp://user:secret@127.0.0.1:1/"

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [CLI_DIR, os.environ.get("PYTHONPATH")])),
            "CLI_TEST_DB_URL": db_url,
            "CLI_TEST_MQ_URL": mq_url,
        }
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "outbox_inbox.cli.main",
                "run",
                "all",
                "--app",
                "cli_app:billing",
                "--metrics-port",
                str(port),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1, result
    assert f"error: cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr
