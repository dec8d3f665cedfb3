"""The dashboard over real HTTP: who may use it, CSRF, escaping, purge and queue replay, and
what bad input gets. The `outbox-inbox dashboard` command runs as a process on loopback."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path

import pika
from cli_support import base_env, command
from dash_support import INVOICE, TOKEN, RunningDashboard, csrf_of, dead_ids, set_failing, wait_dead

from helpers import scalar, wait_until
from outbox_inbox import Service
from outbox_inbox.messages import H_DEAD_REASON, H_ORIGINAL_EXCHANGE, H_ORIGINAL_ROUTING_KEY


def _send(service: Service, payload: dict[str, object]) -> None:
    with service.session() as session, session.begin():
        service.outbox.send(session, "billing", "invoice.create", payload)


def _confirm_and_post(
    dashboard: RunningDashboard, action: str, source: str, ids: list[str]
) -> tuple[str, str]:
    """GET the confirmation page as a browser would (keeping the cookie), return the
    cookie header and the form's CSRF token."""
    query = urllib.parse.urlencode(
        [("service", "billing"), ("source", source), ("action", action)] + [("id", i) for i in ids]
    )
    page = dashboard.request(f"/confirm?{query}")
    assert page.status == 200, page.body
    cookie = "; ".join(f"{k}={v}" for k, v in page.cookies.items())
    return cookie, csrf_of(page.body)


def test_refuses_to_serve_on_a_network_address_without_a_token(
    dash_env: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        command("dashboard", "--service", "billing", "--db-url", db_url, "--host", "0.0.0.0"),
        cwd=tmp_path,
        env=base_env(dash_env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    assert "refusing to serve the dashboard on 0.0.0.0" in done.stderr
    assert "dashboard on" not in done.stdout


def test_with_a_token_every_request_needs_it_as_basic_or_bearer(
    billing: Service, start_dashboard: Callable[..., RunningDashboard]
) -> None:
    dashboard = start_dashboard(env={"OUTBOX_INBOX_DASHBOARD_TOKEN": TOKEN})
    anonymous = dashboard.request("/")
    assert anonymous.status == 401
    assert anonymous.headers["WWW-Authenticate"].startswith("Basic ")
    assert "billing" not in anonymous.body
    wrong = base64.b64encode(b"ada:not-the-token-at-all").decode()
    assert dashboard.request("/", headers={"Authorization": f"Basic {wrong}"}).status == 401
    basic = base64.b64encode(f"ada:{TOKEN}".encode()).decode()
    assert dashboard.request("/", headers={"Authorization": f"Basic {basic}"}).status == 200
    bearer = dashboard.request(
        "/service?name=billing", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert bearer.status == 200 and "0 dead letter(s)" in bearer.body


def test_without_a_token_a_non_loopback_host_header_is_refused(
    billing: Service, start_dashboard: Callable[..., RunningDashboard]
) -> None:
    dashboard = start_dashboard()
    assert dashboard.request("/").status == 200
    rebound = dashboard.request("/", headers={"Host": "attacker.example:8089"})
    assert rebound.status == 421
    assert "billing" not in rebound.body


def test_a_forged_or_cross_origin_form_changes_nothing_and_escaping_holds(
    billing: Service,
    spawn: Callable[..., subprocess.Popen[str]],
    start_dashboard: Callable[..., RunningDashboard],
    db_url: str,
) -> None:
    set_failing(billing, INVOICE)
    spawn("run", "worker", "--app", "cli_app:billing")
    spawn("run", "relay", "--app", "cli_app:billing")
    spawn("run", "receiver", "--app", "cli_app:billing")
    _send(billing, {"html": "<b onclick=x>bold</b>"})
    (dead,) = wait_dead(db_url, 1)
    dashboard = start_dashboard()

    detail = dashboard.request(f"/letter?service=billing&source=table&id={dead}")
    assert detail.status == 200
    assert "&lt;b onclick=x&gt;bold&lt;/b&gt;" in detail.body
    assert "<b onclick" not in detail.body
    assert "default-src 'none'" in detail.headers["Content-Security-Policy"]

    cookie, token = _confirm_and_post(dashboard, "purge", "table", [dead])
    form = {"service": "billing", "source": "table", "action": "purge", "id": dead}
    refused = [
        dashboard.request("/act", data={**form, "csrf": token}),  # no cookie
        dashboard.request("/act", data={**form, "csrf": "0" * 64}, headers={"Cookie": cookie}),
        dashboard.request(
            "/act",
            data={**form, "csrf": token},
            headers={"Cookie": cookie, "Origin": "http://attacker.example"},
        ),
    ]
    assert [r.status for r in refused] == [403, 403, 403]
    assert dead_ids(db_url) == [dead]
    assert dashboard.audit() == []

    purged = dashboard.request("/act", data={**form, "csrf": token}, headers={"Cookie": cookie})
    assert purged.status == 200 and "Purged 1 of 1" in purged.body
    assert dead_ids(db_url) == []
    # (billing sent the command to itself: the fault of its death came back, and stays.)
    left = "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE routing_key NOT LIKE '%.fault.%'"
    assert scalar(db_url, left) == 0
    (line,) = dashboard.audit()
    assert line["command"] == "dashboard purge" and line["message_ids"] == [dead]

    again = dashboard.request("/act", data={**form, "csrf": token}, headers={"Cookie": cookie})
    assert again.status == 200 and "Purged 0 of 1" in again.body and "Not found" in again.body


def test_a_message_of_the_dead_letter_queue_is_replayed_into_the_inbox_and_handled(
    billing: Service,
    spawn: Callable[..., subprocess.Popen[str]],
    start_dashboard: Callable[..., RunningDashboard],
    db_url: str,
    mq_url: str,
) -> None:
    message_id = str(uuid.uuid4())
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "dead_letter",
            "billing",
            json.dumps({"from": "queue"}).encode(),
            pika.BasicProperties(
                message_id=message_id,
                type=INVOICE,
                content_type="application/json",
                delivery_mode=2,
                # What the receiver's forward to the dead-letter exchange carries.
                headers={
                    H_DEAD_REASON: "store_failed: database down",
                    H_ORIGINAL_EXCHANGE: "commands",
                    H_ORIGINAL_ROUTING_KEY: INVOICE,
                },
            ),
        )
    finally:
        connection.close()
    spawn("run", "all", "--app", "cli_app:billing")
    dashboard = start_dashboard()

    listed = dashboard.request("/service?name=billing&source=queue")
    assert listed.status == 200 and message_id in listed.body
    cookie, token = _confirm_and_post(dashboard, "replay", "queue", [message_id])
    form = {"service": "billing", "source": "queue", "action": "replay", "id": message_id}
    replayed = dashboard.request("/act", data={**form, "csrf": token}, headers={"Cookie": cookie})
    assert replayed.status == 200 and "Replayed 1 of 1" in replayed.body
    wait_until(
        lambda: scalar(db_url, "SELECT count(*) FROM effects WHERE message_id = :m", m=message_id),
        what="the replayed message handled",
    )
    assert message_id not in dashboard.request("/service?name=billing&source=queue").body


def test_bad_input_gets_a_clear_page_and_a_4xx(
    billing: Service, start_dashboard: Callable[..., RunningDashboard]
) -> None:
    dashboard = start_dashboard()
    cases = {
        "/service?name=nobody": (404, "no service &#x27;nobody&#x27;"),
        "/letter?service=billing&source=bogus&id=x": (400, "no dead-letter source"),
        "/service?name=billing&older_than=soon": (400, "not a duration"),
        "/service?name=billing&type=orders..x": (400, "not a routing key"),
        "/letter?service=billing&source=table&id=" + str(uuid.uuid4()): (404, "no dead letter"),
        "/confirm?service=billing&source=table&action=delete&id=x": (400, "unknown action"),
        "/nowhere": (404, "no page"),
    }
    for path, (status, text) in cases.items():
        reply = dashboard.request(path)
        assert (reply.status, text in reply.body) == (status, True), (path, reply.body[-500:])
    dashboard.process.terminate()
    assert dashboard.process.wait(timeout=15) == 0


def test_a_port_in_use_is_named_with_its_host_in_the_error(
    billing: Service, dash_env: dict[str, str], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            command("dashboard", "--app", "cli_app:billing", "--port", str(port)),
            cwd=tmp_path,
            env=base_env(dash_env),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 1, done
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
