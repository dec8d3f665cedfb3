"""Benchmark of the tenants fleet (outbox_inbox.tenants), an entry point of its own:

    .venv/bin/python bench/tenants.py [--tenants 1000] [--rate 200] [--seconds 20]
                                      [--idle-seconds 30] [--down-seconds 30]

On its own PostgreSQL and RabbitMQ (outbox_inbox.testing.servers), stopped at the end, one
service ``bench`` run in a process of its own (``Service.run``, as `outbox-inbox run all` runs
it: relay, receiver, worker and the fleet's threads), the writer in this one; for 1 and then
for --tenants schema tenants in one database, one of them active:

- latency: --rate messages a second for --seconds, each sent in its own transaction of the
  active tenant's session, stored by the receiver in the tenant's inbox; commit -> handled
  p50/p99 (the handler's ``clock_timestamp()``);
- idle: --idle-seconds with no message, once the sweep has probed every tenant once (its first
  round after a start loads their catalogue into the server session it runs on): the service
  process's CPU seconds and the machine's, and the most server connections held
  (pg_stat_activity, sampled every second);
- tenant down (database-per-tenant, 4 tenant databases, --rate spread over them): the other
  tenants' p99 for --down-seconds each with all four written, then with one (d0) up but not
  written (the others' load alone), then with d0 refusing connections (``ALTER DATABASE ...
  ALLOW_CONNECTIONS false`` and its sessions terminated) under the same load; the target
  compares the last two (its own clients' refused connections are theirs, not the fleet's);
  then every message committed in d0 is handled once;
- fairness: --fair-tenants schema tenants sent --fair-rate messages a second each for
  --seconds: the lowest, median and highest of their commit -> handled p99, each stage's p99,
  and the CPU a message of the service's process and of the whole machine (--only fair runs
  this phase alone).

The --tenants schemas: the active one migrated by alembic, the others ``pg_dump --schema``
copies of it (the text of the dump with the schema's name replaced, run by psql), since alembic
takes about a second a schema. A benchmark, not a test: it fails only when a phase cannot end.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # as bench/run.py: the repository root on the path, not bench/
    _here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(_here)]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import contextlib
import logging
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import create_engine, text

from outbox_inbox import Message, Service, Tenant, tenants
from outbox_inbox.testing.servers import PostgresServer, RabbitMQServer

TEMPLATE = "bench_tenant_template"
EFFECTS = (
    "CREATE TABLE IF NOT EXISTS public.bench_effects (message_id text NOT NULL,"
    " tenant text NOT NULL, handled_at timestamptz NOT NULL DEFAULT clock_timestamp())"
)


def _handler(message: Message, session: Any) -> None:
    session.execute(
        text("INSERT INTO public.bench_effects (message_id, tenant) VALUES (:m, :t)"),
        {"m": str(message.message_id), "t": message.tenant},
    )


def _service(db_url: str, mq_url: str, registry: dict[str, Tenant]) -> Service:
    svc = Service("bench", db_url=db_url, mq_url=mq_url, tenants=registry, processes=1, lease=10.0)
    svc.on_command("order.place")(_handler)
    return svc


def _libpq(url: str) -> str:
    return url.replace("+psycopg", "")


def _psql(pg: PostgresServer, db: str, script: str) -> None:
    subprocess.run(
        [
            str(pg.bin_dir / "psql"),
            "-q",
            "-1",  # one transaction: one commit (and one flush) for the whole script
            "-v",
            "ON_ERROR_STOP=1",
            pg.url(db).replace("+psycopg", ""),
        ],
        input=script.encode(),
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _schemas(pg: PostgresServer, db: str, count: int) -> dict[str, Tenant]:
    """`count` schema tenants in `db`: t0 migrated, the others copies of a migrated template."""
    url = pg.url(db)
    svc = _service(url, "amqp://unused", {"t0": Tenant(schema="t0"), "x": Tenant(schema=TEMPLATE)})
    svc.migrate()
    svc.tenant("t0").migrate()
    with svc.engine.begin() as conn:
        conn.execute(text(EFFECTS))
    if count > 1:
        svc.tenant("x").migrate()
        dump = subprocess.run(
            [
                str(pg.bin_dir / "pg_dump"),
                "--schema-only",
                "--schema",
                TEMPLATE,
                url.replace("+psycopg", ""),
            ],
            check=True,
            capture_output=True,
        ).stdout.decode()
        started = time.monotonic()
        for first in range(1, count, 100):
            copies = [
                dump.replace(TEMPLATE, f"t{n}") for n in range(first, min(first + 100, count))
            ]
            _psql(pg, db, "\n".join(copies))
        print(f"  {count - 1} schemas copied in {time.monotonic() - started:.0f} s", flush=True)
        with svc.engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {TEMPLATE} CASCADE"))
        # Analysed now, not by autovacuum's first visit of every new table during the phase:
        # long-lived tenants' tables are not all new at once.
        vacuum = create_engine(url, isolation_level="AUTOCOMMIT")
        with vacuum.connect() as conn:
            conn.execute(text("VACUUM (ANALYZE)"))
        vacuum.dispose()
    svc.close()
    return {f"t{n}": Tenant(schema=f"t{n}") for n in range(count)}


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


class Load:
    """Sends --rate messages a second in the tenants' sessions, spread over `active`."""

    def __init__(self, svc: Service, active: list[str], rate: float) -> None:
        self.svc, self.active, self.rate = svc, active, rate
        self.committed: dict[str, tuple[str, float]] = {}  # message id -> (tenant, wall time)
        self.failed = 0

    def run(self, seconds: float) -> None:
        started, n = time.monotonic(), 0
        while (now := time.monotonic()) < started + seconds:
            target = started + n / self.rate
            if target > now:
                time.sleep(target - now)
            tenant = self.active[n % len(self.active)]
            n += 1
            t = self.svc.tenant(tenant)
            try:
                with t.session() as session, session.begin():
                    mid = t.outbox.send(session, "bench", "order.place", {"n": n})
            except Exception:
                self.failed += 1
                continue
            self.committed[str(mid)] = (tenant, time.time())

    def latencies(
        self, dbs: list[str], since: int = 0, timeout: float = 120
    ) -> dict[str, list[float]]:
        """Seconds from commit to handled, by tenant, once every message was handled once."""
        ids = list(self.committed)[since:]
        handled: dict[str, list[float]] = {}
        deadline = time.monotonic() + timeout
        while True:
            found: dict[str, list[float]] = {}
            for db in dbs:
                engine = create_engine(db)
                with engine.connect() as conn:
                    for mid, at in conn.execute(
                        text("SELECT message_id, extract(epoch FROM handled_at) FROM bench_effects")
                    ):
                        found.setdefault(mid, []).append(float(at))
                engine.dispose()
            if all(m in found for m in ids) or time.monotonic() > deadline:
                break
            time.sleep(1)
        missing = [m for m in ids if m not in found]
        doubled = [m for m in ids if len(found.get(m, [])) > 1]
        if missing or doubled:
            raise RuntimeError(f"{len(missing)} messages not handled, {len(doubled)} twice")
        for mid in ids:
            tenant, at = self.committed[mid]
            handled.setdefault(tenant, []).append(found[mid][0] - at)
        return handled


@contextlib.contextmanager
def _fleet(svc: Service) -> Iterator[int]:
    """`svc` run (``Service.run``) in a process of its own, as `outbox-inbox run all` runs it:
    the bench's writer does not share its interpreter lock. Yields its pid."""

    def serve() -> None:
        for engine in [svc.engine, *svc._engines.values()]:  # no tenant's Service made here
            engine.dispose(close=False)  # the parent's connections stay the parent's
        svc.run()

    fleet = multiprocessing.get_context("fork").Process(target=serve, daemon=True)
    fleet.start()
    try:
        time.sleep(5)
        assert fleet.pid is not None
        yield fleet.pid
    finally:
        fleet.terminate()
        fleet.join(30)


def _idle(pid: int, db_url: str, seconds: float, settled: float) -> tuple[float, float, int]:
    """CPU seconds of process `pid` and of the machine (the database's sweep probes included),
    and the most server connections, over `seconds` idle from 5 s on, and not before the
    monotonic time `settled`."""
    time.sleep(max(5.0, settled - time.monotonic()))
    engine = create_engine(db_url)
    held = 0
    cpu, machine = _cpu(pid), _cpu()
    end = time.monotonic() + seconds
    with engine.connect() as conn:
        while time.monotonic() < end:
            sql = "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            sql += " AND backend_type = 'client backend'"
            held = max(held, int(conn.execute(text(sql)).scalar_one()))
            conn.commit()
            time.sleep(1)
    cpu, machine = _cpu(pid) - cpu, _cpu() - machine
    engine.dispose()
    return cpu, machine, held


def _schema_phase(
    pg: PostgresServer, mq: str, count: int, args: argparse.Namespace
) -> dict[str, float]:
    db = f"fleet_{count}"
    pg.create_database(db)
    print(f"{count} schema tenants: preparing", flush=True)
    registry = _schemas(pg, db, count)
    svc = _service(pg.url(db), mq, registry)
    with _fleet(svc) as pid:
        # The idle window opens once the sweep has probed every tenant (SWEEP a second): its
        # first round loads each tenant's catalogue into its server session, once a start.
        settled = time.monotonic() + count / tenants.SWEEP + 5
        load = Load(svc, ["t0"], args.rate)
        load.run(args.seconds)
        lat = load.latencies([pg.url(db)])["t0"]
        cpu, machine, held = _idle(pid, pg.url(db), args.idle_seconds, settled)
    svc.close()
    figures = {"p50": _p(lat, 50), "p99": _p(lat, 99), "cpu": cpu, "machine": machine}
    figures["connections"] = held
    print(f"  {figures}", flush=True)
    return figures


def _down_phase(pg: PostgresServer, mq: str, args: argparse.Namespace) -> dict[str, float]:
    control = "fleet_down"
    pg.create_database(control)
    names = [f"fleet_down_{n}" for n in range(4)]
    registry = {}
    for n, name in enumerate(names):
        pg.create_database(name)
        registry[f"d{n}"] = Tenant(db_url=pg.url(name))
    svc = _service(pg.url(control), mq, registry)
    svc.migrate()
    for db in [control, *names]:
        with create_engine(pg.url(db)).begin() as conn:
            conn.execute(text(EFFECTS))
    for tenant in registry:
        svc.tenant(tenant).migrate()
    dbs = [pg.url(db) for db in [control, *names]]
    admin = create_engine(pg.url("postgres"), isolation_level="AUTOCOMMIT")

    def allow(value: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{names[0]}" ALLOW_CONNECTIONS {value}'))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                {"d": names[0]},
            )

    others = [t for t in registry if t != "d0"]
    try:
        with _fleet(svc):
            load = Load(svc, list(registry), args.rate)  # all four written
            load.run(args.down_seconds)
            calm = load.latencies(dbs)
            alone = Load(svc, others, args.rate * 3 / 4)  # d0 up, not written: the same others
            alone.run(args.down_seconds)
            idle = alone.latencies(dbs)
            mark = len(alone.committed)
            allow(False)  # its unsent and unhandled rows wait in it
            alone.run(args.down_seconds)  # the others' load as in the period before
            allow(True)
            down = alone.latencies(dbs, since=mark)
    finally:
        allow(True)
        svc.close()
        admin.dispose()
    stopped = sum(1 for t, _ in load.committed.values() if t == "d0")
    figures = {
        "p99_up": _p([v for t in others for v in calm[t]], 99),
        "p99_idle": _p([v for t in others for v in idle[t]], 99),
        "p99_down": _p([v for t in others for v in down[t]], 99),
        "stopped_committed": stopped,
    }
    print(f"  {figures}", flush=True)
    return figures


def _cpu(pid: int | None = None) -> float:
    """CPU seconds of process `pid` (user and system), or of the whole machine (busy)."""
    if pid is None:
        times = [int(n) for n in Path("/proc/stat").read_text().split()[1:8]]
        return (sum(times) - times[3] - times[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stages(db_url: str, schemas: list[str]) -> dict[str, float]:
    """The p99 seconds of each stage over `schemas`: commit -> published (the relay fleet),
    published -> stored (the broker and the receiver), stored -> handled (the worker fleet)."""
    parts = [
        f"SELECT o.created_at, o.published_at, i.received_at, i.processed_at"
        f" FROM {s}.outbox_messages o JOIN {s}.inbox_messages i USING (message_id)"
        for s in schemas
    ]
    engine = create_engine(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text(" UNION ALL ".join(parts))).all()
    engine.dispose()
    return {
        f"{name}_p99": _p([(b - a).total_seconds() for a, b in pairs], 99)
        for name, pairs in (
            ("published", [(r[0], r[1]) for r in rows]),
            ("stored", [(r[1], r[2]) for r in rows]),
            ("handled", [(r[2], r[3]) for r in rows]),
        )
    }


def _fair_phase(pg: PostgresServer, mq: str, args: argparse.Namespace) -> dict[str, float]:
    """--fair-tenants schema tenants, each sent --fair-rate messages a second: the spread of
    their commit -> handled p99 (the issue's target: within 2 x of each other)."""
    db = "fleet_fair"
    pg.create_database(db)
    print(f"{args.fair_tenants} tenants at {args.fair_rate:g} msg/s each: preparing", flush=True)
    registry = _schemas(pg, db, args.fair_tenants)
    svc = _service(pg.url(db), mq, registry)
    with _fleet(svc) as pid:
        print(f"  the fleet runs in process {pid}", flush=True)
        load = Load(svc, list(registry), args.fair_rate * len(registry))
        started, cpu = time.monotonic(), (_cpu(pid), _cpu())
        load.run(args.seconds)
        sent = len(load.committed) / (time.monotonic() - started)
        p99s = sorted(_p(v, 99) for v in load.latencies([pg.url(db)]).values())
        n = len(load.committed) / 1e6
        stages = {"fleet_us": (_cpu(pid) - cpu[0]) / n, "machine_us": (_cpu() - cpu[1]) / n}
        stages.update(_stages(pg.url(db), list(registry)))
    svc.close()
    figures = {"sent_per_s": sent, "p99_min": p99s[0], "p99_max": p99s[-1]}
    figures["p99_median"] = statistics.median(p99s)
    figures.update(stages)
    print(f"  {figures}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--down-seconds", type=float, default=30.0)
    parser.add_argument("--fair-tenants", type=int, default=100)
    parser.add_argument("--fair-rate", type=float, default=5.0)
    parser.add_argument("--only", choices=["many", "down", "fair"], help="run this phase alone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    load = os.getloadavg()
    pg, mq = PostgresServer(), RabbitMQServer()
    try:
        print("starting PostgreSQL and RabbitMQ ...", flush=True)
        pg.start()
        mq.start()
        if args.only:
            phase = {"many": _schema_phase, "down": _down_phase, "fair": _fair_phase}[args.only]
            more = (args.tenants,) if args.only == "many" else ()
            print(f"\n{phase(pg, mq.url, *more, args)}")  # type: ignore[operator]
            return 0
        one = _schema_phase(pg, mq.url, 1, args)
        many = _schema_phase(pg, mq.url, args.tenants, args)
        down = _down_phase(pg, mq.url, args)
        fair = _fair_phase(pg, mq.url, args)
    finally:
        mq.stop()
        pg.stop()
    n = args.tenants
    print(f"\ntenants fleet, load average before the run {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'':34}{'1 tenant':>12}{f'{n} tenants':>14}{'ratio':>8}  target")
    for key, what, scale, target in (
        ("p50", "commit -> handled p50 (ms)", 1000, ""),
        ("p99", "commit -> handled p99 (ms)", 1000, "<= 2"),
        ("cpu", f"CPU s over {args.idle_seconds:g} s idle", 1, "<= 1.2"),
        ("machine", "  the machine's, database included", 1, ""),
        ("connections", "server connections held", 1, "= 1"),
    ):
        if key in one:
            a, b = one[key] * scale, many[key] * scale
            print(f"{what:34}{a:12.1f}{b:14.1f}{b / a if a else 0:8.2f}  {target}")
    change = (down["p99_down"] / down["p99_idle"] - 1) * 100
    print(
        f"tenant database down {args.down_seconds:g} s: others' p99 {down['p99_idle'] * 1000:.1f}"
        f" ms with it up and not written -> {down['p99_down'] * 1000:.1f} ms with it down"
        f" ({change:+.1f} %, target within 20 %; {down['p99_up'] * 1000:.1f} ms with it written);"
        f" {down['stopped_committed']:.0f} messages of the stopped tenant, each handled once"
    )
    ms = {k: fair[k] * 1000 for k in ("p99_min", "p99_median", "p99_max")}
    print(
        f"{args.fair_tenants} tenants at {args.fair_rate:g} msg/s each"
        f" (sent {fair['sent_per_s']:.0f} msg/s): their p99 from {ms['p99_min']:.1f}"
        f" to {ms['p99_max']:.1f} ms (median {ms['p99_median']:.1f}):"
        f" max/min {ms['p99_max'] / ms['p99_min']:.2f}, target <= 2"
    )
    print(
        f"  p99 by stage: commit -> published {fair['published_p99'] * 1000:.0f} ms, -> stored"
        f" {fair['stored_p99'] * 1000:.0f} ms, -> handled {fair['handled_p99'] * 1000:.0f} ms;"
        f" CPU a message: the fleet's process {fair['fleet_us']:.0f} us, the machine's"
        f" {fair['machine_us']:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
