"""Benchmark of the claim check (large payloads by reference), an entry point of its own:

    .venv/bin/python bench/claim_check.py [--repeats 5] [--mib 5]

For each store (PostgreSQL, directory), with every role of two services running: the time from
the commit of a publish to its handler's call, for a 1 KiB payload (inline) and a --mib MiB one
(by reference); the raw write (in a committed transaction) and read of the same bytes through
the store alone; and the size of the large message on the broker. It prints the issue's
target: publish -> handled of the large payload <= 3 x the small one's + the raw write and
read. Medians of --repeats runs. A benchmark, not a test: it fails only when a phase cannot
finish. Its own PostgreSQL and RabbitMQ (outbox_inbox.testing.servers), stopped at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # as bench/run.py: the repository root on the path, not bench/
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import statistics
import tempfile
import threading
import time
from typing import Any

import pika

from outbox_inbox import Message, Service
from outbox_inbox.claim_check import DirectoryPayloadStore, PayloadStore, PostgresPayloadStore
from outbox_inbox.testing.servers import PostgresServer, RabbitMQServer


def _payload(size: int) -> dict[str, Any]:
    return {"blob": "x" * (size - 12)}  # about `size` bytes of JSON


def _services(
    pg: PostgresServer, mq_url: str, tag: str, store: PayloadStore, source: PayloadStore | None
) -> tuple[Service, Service, threading.Event]:
    for name in (f"{tag}_a", f"{tag}_b"):
        pg.create_database(name)
    fast = {"processes": 1, "worker_poll_interval": 0.5, "relay_poll_interval": 1.0}
    a = Service("cca", db_url=pg.url(f"{tag}_a"), mq_url=mq_url, payload_store=store, **fast)
    b = Service(
        "ccb", db_url=pg.url(f"{tag}_b"), mq_url=mq_url, payload_sources=[source or store], **fast
    )
    handled = threading.Event()

    @b.on_event("cca.blob.stored")
    def on_blob(message: Message, session: Any) -> None:
        assert isinstance(message.payload, dict) and "blob" in message.payload
        handled.set()

    for svc in (a, b):
        svc.migrate()
    b.declare_topology()
    return a, b, handled


def _publish_to_handled(
    a: Service, handled: threading.Event, size: int, repeats: int
) -> tuple[float, float]:
    """Medians of the time and of this process's CPU (every role of both services runs in it,
    the servers' CPU is not counted) from a publish to its handler's call."""
    payload, times, cpus = _payload(size), [], []
    for _ in range(repeats + 1):  # the first one warms up
        handled.clear()
        started, cpu = time.perf_counter(), time.process_time()
        with a.session() as session, session.begin():
            a.outbox.publish(session, "blob.stored", payload)
        if not handled.wait(120):
            raise RuntimeError("a message was not handled within 120 s")
        times.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
    return statistics.median(times[1:]), statistics.median(cpus[1:])


def _raw(a: Service, store: PayloadStore, reader: PayloadStore, size: int, repeats: int) -> float:
    data = json.dumps(_payload(size)).encode()
    times = []
    for n in range(repeats):
        key = f"00000000-0000-4000-8000-{n:012d}"
        started = time.perf_counter()
        with a.session() as session, session.begin():
            store.put(session, key, data)
        assert reader.get(key) == data
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _broker_size(mq_url: str, a: Service, size: int) -> int:
    """Body plus headers (as JSON) of one large message, read from a queue of its own."""
    connection = pika.BlockingConnection(pika.URLParameters(mq_url))
    try:
        channel = connection.channel()
        channel.queue_declare("cc-spy", auto_delete=False)
        channel.queue_bind("cc-spy", "events", "cca.#")
        with a.session() as session, session.begin():
            a.outbox.publish(session, "blob.stored", _payload(size))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            method, props, body = channel.basic_get("cc-spy", auto_ack=True)
            if method is not None:
                channel.queue_delete("cc-spy")
                return len(body) + len(json.dumps(props.headers or {}))
            time.sleep(0.1)
        raise RuntimeError("the spy queue got nothing within 60 s")
    finally:
        connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib", type=float, default=5.0)
    args = parser.parse_args(argv)
    large, small = int(args.mib * 1024 * 1024), 1024
    pg, mq = PostgresServer(), RabbitMQServer()
    rows = []
    try:
        print("starting PostgreSQL and RabbitMQ ...", flush=True)
        pg.start()
        mq.start()
        with tempfile.TemporaryDirectory() as directory:
            cases: list[tuple[str, PayloadStore, PayloadStore | None]] = [
                ("postgresql", PostgresPayloadStore("cca"), None),
                ("directory", DirectoryPayloadStore("shared", directory), None),
            ]
            for n, (label, store, source) in enumerate(cases):
                if label == "postgresql":
                    source = PostgresPayloadStore("cca", db_url=pg.url(f"cc{n}_a"))
                a, b, handled = _services(pg, mq.url, f"cc{n}", store, source)
                a.start(receiver=False, workers=0)
                b.start(relay=False)
                try:
                    t_small, c_small = _publish_to_handled(a, handled, small, args.repeats * 4)
                    t_large, c_large = _publish_to_handled(a, handled, large, args.repeats)
                    writer = a.settings.payload_store
                    assert writer is not None
                    raw = _raw(a, writer, source or store, large, args.repeats)
                    size = _broker_size(mq.url, a, large)
                finally:
                    a.stop()
                    b.stop()
                    a.close()
                    b.close()
                bound = 3 * t_small + raw
                ratio = t_large / bound
                rows.append((label, t_small, t_large, raw, bound, ratio, size, c_small, c_large))
    finally:
        mq.stop()
        pg.stop()
    print(f"\nclaim check, {args.mib:g} MiB payload by reference, medians of {args.repeats} runs")
    head = ("store", "1 KiB ms", "large ms", "raw w+r ms", "3x1KiB+raw ms", "ratio", "broker B")
    print("  ".join(f"{h:>13}" for h in (*head, "1 KiB cpu ms", "large cpu ms")))
    for label, t1, t5, raw, bound, ratio, size, c1, c5 in rows:
        values = (label, *(f"{v * 1000:.1f}" for v in (t1, t5, raw, bound)), f"{ratio:.2f}")
        cpu = (f"{c1 * 1000:.1f}", f"{c5 * 1000:.1f}")
        print("  ".join(f"{v:>13}" for v in (*values, str(size), *cpu)))
    print("target: ratio <= 1.00 (large <= 3 x 1 KiB + raw write and read); broker <= 4096 B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
