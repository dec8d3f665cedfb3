"""Benchmark of webhooks out, an entry point of its own:

    .venv/bin/python bench/webhooks.py [--events 1000] [--concurrency 4] [--seconds 20]

Two figures against a local HTTP endpoint (http.server in threads of this process, 127.0.0.1),
with its own PostgreSQL (outbox_inbox.testing.servers), stopped at the end:

- throughput: --events events written in one transaction, then the webhooks role started with
  ``max_in_flight=--concurrency``: the time until every delivery is marked, against a raw loop
  of the same number of signed urllib POSTs from --concurrency threads (the issue's target:
  the library's rate >= 0.5 x the raw loop's);
- isolation: events published at a steady rate for --seconds to two endpoints, ``a`` and
  ``b``; the p99 of ``b``'s latency (commit to request received) while ``a`` answers 200, then
  while ``a`` answers 500 (retried on a one-second schedule): the target is a p99 at most 10 %
  higher.

A benchmark, not a test: it fails only when a phase cannot finish.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # as bench/run.py: the repository root on the path, not bench/
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import base64
import json
import logging
import statistics
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sqlalchemy import text

from outbox_inbox import Service
from outbox_inbox.testing.servers import PostgresServer
from outbox_inbox.webhooks import Webhook, WebhookRole, signature

SECRET = "whsec_" + base64.b64encode(b"bench secret of thirty-two bytes").decode()


class Endpoint:
    """Counts POSTs by path with their arrival times; a path in `failing` answers 500."""

    def __init__(self) -> None:
        self.arrivals: dict[str, dict[str, float]] = {}
        self.failing: set[str] = set()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                now = time.perf_counter()
                with outer.lock:
                    seen = outer.arrivals.setdefault(self.path, {})
                    seen.setdefault(self.headers.get("webhook-id") or str(len(seen)), now)
                self.send_response(500 if self.path in outer.failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.request_queue_size = 128
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, path: str) -> int:
        with self.lock:
            return len(self.arrivals.get(path, {}))


def _raw_loop(url: str, events: int, concurrency: int) -> float:
    """Seconds for `events` signed POSTs from `concurrency` threads, plain urllib."""
    body = json.dumps({"type": "bench.order.placed", "data": {"n": 1}}).encode()

    def worker(n: int) -> None:
        for _ in range(n):
            webhook_id, stamp = str(uuid.uuid4()), int(time.time())
            headers = {
                "content-type": "application/json",
                "webhook-id": webhook_id,
                "webhook-timestamp": str(stamp),
                "webhook-signature": signature((SECRET,), webhook_id, stamp, body),
            }
            request = urllib.request.Request(url, body, headers, method="POST")
            with urllib.request.urlopen(request, timeout=15) as response:
                response.read()

    shares = [events // concurrency + (i < events % concurrency) for i in range(concurrency)]
    threads = [threading.Thread(target=worker, args=(n,)) for n in shares]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def _service(pg: PostgresServer, name: str, hooks: list[Webhook], **settings: Any) -> Service:
    pg.create_database(name)
    service = Service("bench", db_url=pg.url(name), webhooks=hooks, processes=1, **settings)
    service.migrate()
    return service


def _unsent(service: Service) -> int:
    with service.engine.connect() as conn:
        sql = (
            "SELECT count(*) FROM outbox_inbox.outbox_messages"
            " WHERE exchange LIKE 'webhook:%' AND published_at IS NULL AND dead_at IS NULL"
        )
        return int(conn.execute(text(sql)).scalar_one())


def _throughput(pg: PostgresServer, endpoint: Endpoint, events: int, concurrency: int) -> float:
    hook = Webhook(
        name="t",
        url=f"{endpoint.url}/t",
        patterns="bench.#",
        secrets=SECRET,
        max_in_flight=concurrency,
    )
    service = _service(pg, "wh_throughput", [hook], relay_poll_interval=0.2)
    with service.session() as session, session.begin():
        for n in range(events):
            service.outbox.publish(session, "order.placed", {"n": n})
    role = WebhookRole(
        service="bench", engine=service.engine, tables=service.tables, settings=service.settings
    )
    stop = threading.Event()
    started = time.perf_counter()
    thread = threading.Thread(target=role.run, args=(stop,))
    thread.start()
    try:
        deadline = time.monotonic() + 600
        while _unsent(service) and time.monotonic() < deadline:
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        thread.join()
        service.close()
    if endpoint.count("/t") < events:
        raise RuntimeError("not every event was delivered")
    return elapsed


def _p99_of_b(pg: PostgresServer, endpoint: Endpoint, run: str, seconds: float) -> float:
    """p99 of b's latency, seconds, with events published at 20 per second for `seconds`."""
    hooks = [
        Webhook(name=n, url=f"{endpoint.url}/{run}{n}", patterns="bench.#", secrets=SECRET)
        for n in ("a", "b")
    ]
    service = _service(pg, f"wh_{run}", hooks, relay_poll_interval=0.2, webhook_schedule=(1.0,) * 7)
    role = WebhookRole(
        service="bench", engine=service.engine, tables=service.tables, settings=service.settings
    )
    stop = threading.Event()
    thread = threading.Thread(target=role.run, args=(stop,))
    thread.start()
    committed: dict[str, float] = {}
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            with service.session() as session, session.begin():
                event = str(service.outbox.publish(session, "order.placed", {"at": time.time()}))
            committed[event] = time.perf_counter()
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        while endpoint.count(f"/{run}b") < len(committed) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
        service.close()
    with endpoint.lock:
        arrived = dict(endpoint.arrivals.get(f"/{run}b", {}))
    latencies = sorted(arrived[e] - t for e, t in committed.items() if e in arrived)
    if len(latencies) < len(committed):
        raise RuntimeError("b did not get every event")
    return statistics.quantiles(latencies, n=100)[98]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    logging.getLogger("outbox_inbox.webhooks").setLevel(logging.CRITICAL)  # a's deaths: expected
    pg = PostgresServer()
    endpoint = Endpoint()
    try:
        print("starting PostgreSQL ...", flush=True)
        pg.start()
        raw = _raw_loop(f"{endpoint.url}/raw", args.events, args.concurrency)
        lib = _throughput(pg, endpoint, args.events, args.concurrency)
        calm = _p99_of_b(pg, endpoint, "calm", args.seconds)
        endpoint.failing.add("/faila")
        failing = _p99_of_b(pg, endpoint, "fail", args.seconds)
        a_failed = endpoint.count("/faila")
    finally:
        endpoint.server.shutdown()
        pg.stop()
    n, c = args.events, args.concurrency
    print(f"\nwebhooks: {n} events to a local endpoint, {c} in flight")
    print(f"  raw urllib loop  {raw:7.2f} s  {n / raw:8.1f}/s")
    print(
        f"  webhooks role    {lib:7.2f} s  {n / lib:8.1f}/s  ratio {raw / lib:.2f} (target >= 0.5)"
    )
    print(f"b's p99 latency, events at 20/s for {args.seconds:g} s")
    print(f"  a answers 200    {calm * 1000:7.1f} ms")
    print(f"  a answers 500    {failing * 1000:7.1f} ms  ({a_failed} events to a, all failing)")
    print(f"  change           {(failing / calm - 1) * 100:+7.1f} % (target <= +10 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
