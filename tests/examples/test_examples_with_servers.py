"""The two example services as real processes, each with its own database, on RabbitMQ."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from sqlalchemy import create_engine, text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_EXAMPLE = Path(__file__).resolve().parent / "run_example.py"


class ExampleProcess:
    """One example service started through run_example.py, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, str(RUN_EXAMPLE), *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then the exit status; SIGKILL and None if it did not end in `timeout`."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            return None


@pytest.fixture
def start_example(tmp_path: Path, mq_url: str) -> Iterator[Callable[..., ExampleProcess]]:
    """Start ``examples/<name>/app.py`` with OUTBOX_INBOX_DB_URL=db_url and the test's vhost;
    every process started is SIGKILLed at teardown if still running."""
    started: list[ExampleProcess] = []

    def start(name: str, db_url: str, *args: str) -> ExampleProcess:
        env = dict(os.environ)
        env.update(OUTBOX_INBOX_DB_URL=db_url, OUTBOX_INBOX_MQ_URL=mq_url, PYTHONUNBUFFERED="1")
        process = ExampleProcess(
            name, [str(EXAMPLES / name / "app.py"), *args], env, tmp_path / f"{name}.log"
        )
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """(status, JSON body) of one request; (0, None) when nothing listens yet."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, ConnectionError):
        return 0, None


def queue_exists(mq_url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        connection.channel().queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:  # 404: not declared yet
        return False
    finally:
        if connection.is_open:
            connection.close()


def wait_for(
    condition: Callable[[], Any], what: str, processes: list[ExampleProcess], timeout: float = 30
) -> Any:
    """Poll `condition` until truthy; fail with the processes' logs if one dies or time is up."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        dead = [p for p in processes if p.popen.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name} log:\n{p.log()[-4000:]}" for p in processes)
            why = f"{dead[0].name} exited" if dead else f"timed out after {timeout:g} s"
            pytest.fail(f"waiting for {what}: {why}\n{logs}")
        time.sleep(0.1)


def test_order_posted_to_the_shop_is_invoiced_once_by_billing_over_rabbitmq(
    start_example: Callable[..., ExampleProcess], db_url_factory: Callable[[], str], mq_url: str
) -> None:
    billing_db, shop_db = db_url_factory(), db_url_factory()
    port = free_port()
    billing = start_example("billing", billing_db)
    shop = start_example("shop", shop_db, "--port", str(port))
    processes = [billing, shop]
    base = f"http://127.0.0.1:{port}"
    # A command sent before billing declared its queue would wait in `unroutable` (docs/
    # topology.md): billing must be up first, as examples/README.md says.
    wait_for(lambda: queue_exists(mq_url, "billing.inbox"), "billing's queue", processes)
    wait_for(lambda: http("GET", f"{base}/health")[0] == 200, "the shop to serve", processes)

    status, order = http("POST", f"{base}/orders", {"customer": "ada", "total_cents": 4200})
    assert status == 201, order
    assert order["status"] == "placed"

    invoiced = wait_for(
        lambda: (
            (o := http("GET", f"{base}/orders/{order['id']}")[1])
            and o["status"] == "invoiced"
            and o
        ),
        "the order to be invoiced",
        processes,
    )
    engine = create_engine(billing_db)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT id, order_id, amount_cents FROM invoices")).all()
            account = conn.execute(
                text("SELECT orders FROM accounts WHERE customer = 'ada'")
            ).scalar()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [(invoiced["invoice_id"], order["id"], 4200)]
    assert account == 1  # billing also handled the orders.order.placed event

    # Both services end cleanly on SIGTERM (the roles finish their work in hand).
    assert shop.stop(timeout=20) == 0, shop.log()[-4000:]
    assert billing.stop(timeout=20) == 0, billing.log()[-4000:]
