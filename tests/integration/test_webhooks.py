"""Webhooks out against a real local HTTP server (http.server in a thread, 127.0.0.1, a free
port) and a real PostgreSQL: Standard Webhooks signatures checked by the test's own HMAC; a 2xx
acked once and never sent again, a non-2xx never taken for a success (Wolverine #3173);
3xx/4xx/5xx/timeouts retried on the schedule, then exhausted: a dead letter the dead-letter
tools replay, and a fault event; 410 stops at once; a failing or slow endpoint does not hold
back another; a rolled-back transaction sends nothing; an event sent by reference (the claim
check) is delivered with its payload, or dead ``payload_missing`` without it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from helpers import make_service, rows, running, scalar, wait_until
from outbox_inbox import MemoryBroker, Service
from outbox_inbox.claim_check import DirectoryPayloadStore, PostgresPayloadStore
from outbox_inbox.dashboard.views import Safe, Shown, service_status
from outbox_inbox.dead_letters import OUTBOX, DeadLetters, Filters
from outbox_inbox.status import collect_status, health
from outbox_inbox.webhooks import Webhook, WebhookRole

KEY = b"a test key of the endpoint"
OLD_KEY = b"the key before the rotation"
SECRET = "whsec_" + base64.b64encode(KEY).decode()
OLD_SECRET = "whsec_" + base64.b64encode(OLD_KEY).decode()


class Endpoint:
    """A local HTTP server: records every request by path and answers what `answer` says
    (a status, or a number of seconds to sleep before a 200)."""

    def __init__(self) -> None:
        self.requests: dict[str, list[tuple[dict[str, str], bytes]]] = {}
        self.answers: dict[str, Callable[[int], int | float]] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with outer.lock:
                    seen = outer.requests.setdefault(self.path, [])
                    seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    n = len(seen)
                answer = outer.answers.get(self.path, lambda n: 200)(n)
                if isinstance(answer, float):
                    time.sleep(answer)
                    answer = 200
                self.send_response(answer)
                if 300 <= answer < 400:
                    self.send_header("location", f"{outer.url}/elsewhere")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def count(self, path: str) -> int:
        with self.lock:
            return len(self.requests.get(path, []))


@contextmanager
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def verify(headers: dict[str, str], body: bytes, key: bytes) -> bool:
    """Standard Webhooks 1.0 verification, written here, not imported from the library."""
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        hmac.compare_digest(part.split(",", 1)[1], expected)
        for part in headers["webhook-signature"].split(" ")
        if part.startswith("v1,")
    )


def _service(db_url: str, hooks: list[Webhook], **settings: Any) -> Service:
    values = {"webhook_schedule": (0.05, 0.05, 0.05), "webhook_timeout": 0.5, **settings}
    return make_service("orders", db_url, None, broker=MemoryBroker(), webhooks=hooks, **values)


def _role(service: Service) -> WebhookRole:
    s = service
    return WebhookRole(service=s.name, engine=s.engine, tables=s.tables, settings=s.settings)


def _hook(server: Endpoint, name: str, **options: Any) -> Webhook:
    values: dict[str, Any] = {"patterns": ("orders.order.*",), "secrets": (SECRET,), **options}
    return Webhook(name=name, url=f"{server.url}/{name}", **values)


def _publish(service: Service, n: int = 1, event: str = "order.placed") -> list[str]:
    with service.session() as session, session.begin():
        return [str(service.outbox.publish(session, event, {"n": i})) for i in range(n)]


def _deliveries(db_url: str, name: str) -> list[Any]:
    return rows(
        db_url,
        "SELECT published_at IS NOT NULL AS sent, dead_reason, attempts, last_error"
        " FROM outbox_inbox.outbox_messages WHERE exchange = :e ORDER BY id",
        e=f"webhook:{name}",
    )


def test_a_2xx_is_signed_acked_once_and_never_sent_again(db_url: str) -> None:
    """One request per (event, endpoint), signed with every secret of a rotation: the test's
    own HMAC accepts the new key and the old one; its body is the event. Claimed again after
    the 2xx, the row is not sent again (Wolverine #3173: successful sends redelivered)."""
    with endpoint() as server:
        hook = _hook(server, "crm", secrets=(SECRET, OLD_SECRET))
        service = _service(db_url, [hook])
        [event_id] = _publish(service)
        _publish(service, event="customer.joined")  # no pattern matches it
        role = _role(service)
        assert role.deliver(hook) == 1
        for _ in range(5):
            assert role.deliver(hook) == 0
        assert server.count("/crm") == 1 and role.delivered == 1
        [(headers, body)] = server.requests["/crm"]
        assert verify(headers, body, KEY) and verify(headers, body, OLD_KEY)
        assert not verify(headers, body, b"another key")
        assert headers["webhook-id"] == event_id
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 300
        assert headers["content-type"] == "application/json"
        sent = json.loads(body)
        assert sent["type"] == "orders.order.placed" and sent["data"] == {"n": 0}
        assert [tuple(r) for r in _deliveries(db_url, "crm")] == [(True, None, 0, None)]
        service.close()


def test_non_2xx_and_timeouts_are_retried_then_exhausted_dead_and_replayed(
    db_url: str, tmp_path: Path
) -> None:
    """302, 404, 500 and a timeout: four failed attempts (the schedule's three retries after
    the first), none taken for a success, no redirect followed; then the row is dead
    ``exhausted``, a fault event ``orders.webhook.exhausted`` is written, and the dead-letter
    tools list it and replay it: delivered once the endpoint answers 200."""
    answers = {1: 302, 2: 404, 3: 500, 4: 2.0}
    with endpoint() as server:
        server.answers["/erp"] = lambda n: answers.get(n, 200)
        hook = _hook(server, "erp")
        service = _service(db_url, [hook])
        [event_id] = _publish(service)
        role = _role(service)
        with running(role):
            wait_until(lambda: role.dead == 1, what="exhausted")
        assert server.count("/erp") == 4 and server.count("/elsewhere") == 0
        assert role.delivered == 0 and role.failed == 3
        [(sent, reason, attempts, error)] = _deliveries(db_url, "erp")
        assert (sent, reason, attempts) == (False, "exhausted", 4)
        assert error.startswith("webhook erp: no answer") and "timed out" in error
        [fault] = rows(
            db_url,
            "SELECT payload FROM outbox_inbox.outbox_messages"
            " WHERE routing_key = 'orders.webhook.exhausted'",
        )
        assert fault.payload["message_id"] == event_id
        assert fault.payload["kind"] == "webhook:erp" and fault.payload["reason"] == "exhausted"
        letters = DeadLetters.of(service)
        with letters.select([OUTBOX], Filters(reason="exhausted")) as [selection]:
            [letter] = selection.letters
        assert letter.type == "orders.order.placed" and letter.error == error
        report = letters.replay([OUTBOX], Filters(), audit_log=tmp_path / "audit.log")
        assert len(report.done) == 1
        with running(role):
            wait_until(lambda: role.delivered == 1, what="the replayed delivery")
        assert server.count("/erp") == 5
        assert [r.sent for r in _deliveries(db_url, "erp")] == [True]
        service.close()


GONE_ERROR, LATER_ERROR = "webhook gone: HTTP 410", "webhook later: HTTP 500"


def test_410_stops_the_retries_and_a_failure_waits_its_scheduled_delay(db_url: str) -> None:
    """A 410 Gone: dead ``gone`` after one attempt. A 500 with the first retry an hour away:
    the row is due in about an hour and not sent again meanwhile. `status` shows both
    endpoints, and the relay's backlog leaves their rows out."""
    with endpoint() as server:
        server.answers["/gone"] = lambda n: 410
        server.answers["/later"] = lambda n: 500
        gone, later = _hook(server, "gone"), _hook(server, "later")
        service = _service(db_url, [gone, later], webhook_schedule=(3600, 60))
        _publish(service)
        role = _role(service)
        assert role.deliver(gone) == 1 and role.deliver(later) == 1
        for _ in range(3):
            assert role.deliver(gone) == 0 and role.deliver(later) == 0
        assert server.count("/gone") == 1 and server.count("/later") == 1
        assert [tuple(r)[:3] for r in _deliveries(db_url, "gone")] == [(False, "gone", 1)]
        assert [tuple(r)[:3] for r in _deliveries(db_url, "later")] == [(False, None, 1)]
        due_in = scalar(
            db_url,
            "SELECT extract(epoch FROM available_at - now()) FROM outbox_inbox.outbox_messages"
            " WHERE exchange = 'webhook:later'",
        )
        assert 3000 < due_in <= 3600
        outbox = health(service.engine, service.tables, service="orders", wakeups=False).outbox
        assert outbox["webhooks"] == [
            {"endpoint": "gone", "waiting": 0, "failing": 0, "dead": 1, "last_error": GONE_ERROR},
            {"endpoint": "later", "waiting": 1, "failing": 1, "dead": 0, "last_error": LATER_ERROR},
        ]
        assert outbox["unpublished"] == 2 and outbox["dead"] == 1  # the event and the fault
        status = collect_status(service.engine, service.tables, service="orders", admin=None)
        page = str(service_status(Shown("orders", status), Safe("")))
        shown = re.findall(r"<td[^>]*>([^<]*)</td>", page.split("Webhook endpoints")[1])
        assert shown[:10] == [
            "gone",
            "0",
            "0",
            "1",
            GONE_ERROR,
            "later",
            "1",
            "1",
            "0",
            LATER_ERROR,
        ]
        service.close()


def test_a_failing_or_slow_endpoint_does_not_hold_back_another(db_url: str) -> None:
    """`slow` hangs on its one request in flight (max_in_flight=1) and `down` answers 500:
    meanwhile `fast` gets all twenty events, and `slow` never has two requests at once."""
    release = threading.Event()
    with endpoint() as server:
        server.answers["/down"] = lambda n: 500
        server.answers["/slow"] = lambda n: (release.wait(30), 0.0)[1]
        hooks = [
            _hook(server, "down"),
            _hook(server, "slow", max_in_flight=1),
            _hook(server, "fast", max_in_flight=2),
        ]
        service = _service(db_url, hooks, webhook_timeout=60.0, webhook_schedule=(0.05,) * 2)
        _publish(service, 20)
        role = _role(service)
        with running(role):
            wait_until(lambda: server.count("/fast") == 20, what="fast served")
            assert server.count("/slow") == 1
            release.set()
            wait_until(lambda: server.count("/slow") == 20, what="slow served")
            wait_until(lambda: all(r.sent for r in _deliveries(db_url, "slow")), what="marked")
        assert all(r.sent for r in _deliveries(db_url, "fast"))
        assert not any(r.sent for r in _deliveries(db_url, "down"))
        service.close()


def test_a_rolled_back_transaction_sends_nothing_and_the_relay_leaves_deliveries(
    db_url: str,
) -> None:
    """An event whose transaction rolled back has no delivery; the committed one is sent once.
    The relay publishes the event row and leaves the delivery row to the webhooks role."""
    with endpoint() as server:
        hook = _hook(server, "crm")
        service = _service(db_url, [hook])
        with service.session() as session, session.begin():
            service.outbox.publish(session, "order.placed", {"n": "rolled back"})
            session.rollback()
        [kept] = _publish(service)
        service.declare_topology()
        relay = service.relay()
        assert relay.relay_once() == 1 and relay.published == 1
        role = _role(service)
        with running(role):
            wait_until(lambda: role.delivered == 1, what="the committed event delivered")
            wait_until(lambda: role.deliver(hook) == 0, what="nothing more")
        [(headers, body)] = server.requests["/crm"]
        assert headers["webhook-id"] == kept and json.loads(body)["data"] == {"n": 0}
        service.close()


def test_after_a_request_without_an_answer_the_rest_of_a_claim_goes_back_uncounted(
    db_url: str,
) -> None:
    """An endpoint nobody listens on: of the three rows one claim took, the first gets its
    failed attempt (``no answer``); the two behind it go back due at once, with no attempt
    counted, and are tried by the next claims, one each."""
    with endpoint() as server:
        port = server.server.server_address[1]
    hook = Webhook(
        name="down", url=f"http://127.0.0.1:{port}/x", patterns="orders.#", secrets=SECRET
    )
    service = _service(db_url, [hook], webhook_schedule=(3600,))
    _publish(service, 3)
    role = _role(service)
    assert role.deliver(hook) == 3
    assert [r.attempts for r in _deliveries(db_url, "down")] == [1, 0, 0]
    assert "no answer" in _deliveries(db_url, "down")[0].last_error
    assert role.deliver(hook) == 2 and role.deliver(hook) == 1 and role.deliver(hook) == 0
    assert [r.attempts for r in _deliveries(db_url, "down")] == [1, 1, 1] and role.failed == 3
    service.close()


def test_the_service_runs_the_webhooks_wherever_it_runs_the_relay(db_url: str) -> None:
    """`start()` with the relay starts the webhooks role too; without it, none."""
    with endpoint() as server:
        service = _service(db_url, [_hook(server, "crm")])
        service.declare_topology()
        _publish(service)
        service.start(relay=False, receiver=False, workers=1)
        try:
            assert not any("webhook" in t.name for t in threading.enumerate())
        finally:
            service.stop()
        service.start(receiver=False, workers=0)
        try:
            wait_until(lambda: server.count("/crm") == 1, what="delivered by the service")
        finally:
            service.stop()
            service.close()


def _rows_read(engine: Any, call: Callable[[Any], Any]) -> int:
    """The outbox rows the statement `call` sends reads, by EXPLAIN ANALYZE of it: each scan
    node's rows found and rows its filter removed, in a transaction rolled back."""
    from sqlalchemy import event

    sent: list[tuple[str, Any]] = []
    with engine.connect() as conn:
        event.listen(conn, "before_cursor_execute", lambda *a: sent.append((a[2], a[3])))
        with conn.begin() as transaction:
            call(conn)
            transaction.rollback()
        statement, parameters = sent[-1]
        with conn.begin() as transaction:
            explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + statement
            plan = conn.exec_driver_sql(explain, parameters).scalar_one()[0]["Plan"]
            transaction.rollback()

    def read(node: dict[str, Any]) -> int:
        own = 0
        if "outbox_messages" in node.get("Relation Name", ""):
            own = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        return own + sum(read(child) for child in node.get("Plans", ()))

    return read(plan)


def test_an_endpoints_waiting_deliveries_never_lie_in_the_relays_path_nor_its_backlog_in_theirs(
    db_url: str,
) -> None:
    """20,000 deliveries of a dead endpoint wait for their retry, older than the relay's 10
    rows; 20,000 events wait for the relay, older than the endpoint's 10 due deliveries. Each
    claim reads its own rows only, by its partial index (migration 0013)."""
    from sqlalchemy import text

    from outbox_inbox.queries import roles

    service = make_service("orders", db_url, None)
    insert = text(
        "INSERT INTO outbox_inbox.outbox_messages (message_id, kind, exchange, routing_key,"
        " payload, headers, available_at) SELECT gen_random_uuid(), 'event', :exchange,"
        " 'orders.order.placed', '{}', '{}', now() + make_interval(secs => :later)"
        " FROM generate_series(1, :n)"
    )
    try:
        with service.engine.begin() as conn:
            for exchange, n, later in (
                ("webhook:erp", 20_000, 3600),
                ("events", 10, 0),
                ("events", 20_000, 0),
                ("webhook:erp", 10, -1),
            ):
                conn.execute(insert, {"exchange": exchange, "n": n, "later": later})
            conn.execute(text("ANALYZE outbox_inbox.outbox_messages"))
        relay = _rows_read(service.engine, lambda c: roles.claim_outbox(c, service.tables, 10))
        hook = _rows_read(
            service.engine,
            lambda c: roles.claim_webhooks(c, service.tables, "webhook:erp", 10, 60.0),
        )
    finally:
        service.close()
    assert relay < 100, relay
    assert hook < 100, hook


@pytest.mark.parametrize("kind", ["postgresql", "directory"])
def test_an_event_sent_by_reference_is_delivered_with_its_payload_or_dead_without_it(
    db_url: str, tmp_path: Path, kind: str
) -> None:
    """A payload over `claim_check_bytes` goes to the store and the event row carries a
    reference; the endpoint, which cannot read the store, gets the payload itself in ``data``
    (read when the request is sent) under a signature over it. A payload gone by then: dead
    ``payload_missing`` at once, with its fault event, and no request sent."""
    store = PostgresPayloadStore("orders") if kind == "postgresql" else None
    store = store or DirectoryPayloadStore("files", str(tmp_path))
    with endpoint() as server:
        hook = _hook(server, "crm")
        service = _service(db_url, [hook], payload_store=store)
        big = {"text": "é" * 3000 + "x" * 5000, "n": 1}
        with service.session() as session, session.begin():
            for n in (1, 2):
                service.outbox.publish(session, "order.placed", {**big, "n": n})
        refs = rows(
            db_url,
            "SELECT headers->>'x-payload-ref' AS ref, payload FROM outbox_inbox.outbox_messages"
            " WHERE exchange = 'webhook:crm' ORDER BY id",
        )
        assert [r.payload for r in refs] == [None, None] and all(r.ref for r in refs)
        missing = refs[1].ref.split("/")[1]
        if kind == "postgresql":
            with service.engine.begin() as conn:
                sql = "DELETE FROM outbox_inbox.payloads WHERE key = :k"
                assert conn.execute(text(sql), {"k": missing}).rowcount == 1
        else:
            (tmp_path / missing).unlink()
        role = _role(service)
        assert role.deliver(hook) == 2
        [(headers, body)] = server.requests["/crm"]
        assert verify(headers, body, KEY) and json.loads(body)["data"] == big
        [(sent, *_), (sent_2, reason, attempts, error)] = _deliveries(db_url, "crm")
        assert (sent, sent_2, reason, attempts) == (True, False, "payload_missing", 1)
        assert error.startswith(f"webhook crm: payload {refs[1].ref}")
        [fault] = rows(
            db_url,
            "SELECT payload FROM outbox_inbox.outbox_messages"
            " WHERE routing_key = 'orders.webhook.exhausted'",
        )
        assert fault.payload["reason"] == "payload_missing"
        assert role.deliver(hook) == 0 and server.count("/crm") == 1
        service.close()
