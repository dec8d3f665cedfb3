"""docs/testing.md's real-server command and `outbox-inbox demo` run beside a running service
(getting-started's billing) and leave its queues, bindings and consumer as they were."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import FAST, publish_raw, wait_until
from outbox_inbox import Service
from outbox_inbox.management import ManagementAPI, vhost_of

REPO = Path(__file__).resolve().parents[2]


def _block(page: str, name: str) -> str:
    """The code block of `page` written to file `name` (``<!-- file: name -->``)."""
    text = (REPO / "docs" / page).read_text()
    found = re.search(rf"<!-- file: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert found, f"no {name} in docs/{page}"
    return found[1]


def _broker_state(api: ManagementAPI, service: Service) -> dict[str, Any]:
    """The live service's queues: each one's bindings and consumers."""
    state: dict[str, Any] = {}
    with service.broker.operator() as admin:
        for queue in (q.name for q in service.topology().queues):
            bindings = sorted((b["source"], b["routing_key"]) for b in api.queue_bindings(queue))
            info = admin.queue_info(queue)
            state[queue] = (bindings, None if info is None else info[1])
    return state


def test_the_harness_and_the_demo_leave_a_running_service_alone(
    tmp_path: Path, db_url: str, mq_url: str, postgres_server: Any, rabbitmq_server: Any
) -> None:
    if not getattr(rabbitmq_server, "management_url", None):
        pytest.skip("needs the management API of the local RabbitMQ")
    live = Service("billing", db_url=db_url, mq_url=mq_url, **FAST)
    live.migrate()
    handled: list[object] = []
    live.on_command("invoice.create")(lambda message, session: handled.append(message))
    live.on_event("orders.order.cancelled")(lambda message, session: None)
    api = ManagementAPI(rabbitmq_server.management_url, vhost_of(mq_url))
    live.start()
    try:
        before = _broker_state(api, live)
        assert before["billing.inbox"][1] == 1  # the live receiver consumes

        (tmp_path / "test_billing.py").write_text(_block("testing.md", "test_billing.py"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_INBOX_")}
        env["OUTBOX_INBOX_HARNESS_DB_URL"] = postgres_server.url("postgres")
        env["OUTBOX_INBOX_HARNESS_MQ_URL"] = mq_url
        pytest_command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        runs = {}
        # As docs/testing.md writes it: on a virtual host of its own.
        env["OUTBOX_INBOX_MANAGEMENT_URL"] = rabbitmq_server.management_url
        runs["own vhost"] = _run([*pytest_command, "test_billing.py"], tmp_path, env)
        # No management API: on the live virtual host, where the harness refuses.
        env["OUTBOX_INBOX_MANAGEMENT_URL"] = "http://127.0.0.1:1"
        runs["refused"] = _run([*pytest_command, "test_billing.py"], tmp_path, env)
        demo = ["-m", "outbox_inbox.cli.main", "demo", "--db-url", db_url, "--mq-url", mq_url]
        runs["demo"] = _run([sys.executable, *demo], tmp_path, env)

        assert runs["own vhost"].returncode == 0, runs["own vhost"]
        assert runs["refused"].returncode == 1, runs["refused"]
        assert (
            "ConfigurationError: billing.inbox has a consumer on amqp://" in runs["refused"].stdout
        )
        assert runs["demo"].returncode == 0, runs["demo"]
        assert "demo_orders.order.placed" in runs["demo"].stdout, runs["demo"]

        assert _broker_state(api, live) == before
        publish_raw(
            mq_url, "commands", "billing.invoice.create", b'{"order_id": 1}', message_id="m-1"
        )
        wait_until(lambda: handled, what="the live service handling a command")
        assert len(handled) == 1  # and none of the tests' or the demo's
    finally:
        live.stop()
        live.close()


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False
    )
