"""An hour of messages under every fault at random: nothing lost or doubled, nothing drifting.

``scripts/test -m soak`` runs it (the default run skips it: it takes an hour;
``OUTBOX_INBOX_SOAK_SECONDS`` shortens it). The fault kit (`outbox_inbox.testing.faultkit`)
runs the jobs service of tests/faults/kit_apps.py (receiver and worker processes) fed by a
producer's relay process, on the session's private servers, while a load commits 100 to 300
transactions a second (the rate changes every fault) and one fault at random from `FAULTS` is
injected every `INTERVAL` seconds. Every `SAMPLE` seconds it samples the RSS of each role
process, the sessions the services hold on PostgreSQL and on RabbitMQ, and the size of each
database. At the end it checks:

* the checker's verdict: nothing lost, duplicated or unexpected;
* every fault recovered within `RECOVERY_BOUND` (everything committed by its end handled);
* the RSS of a role process that lived through the second half grew by less than
  `RSS_GROWTH` over it (a leak shows as a steady climb); the sessions never exceeded
  `MAX_SESSIONS`; the bytes per stored message at the end within 50 % of the first sample's
  (the tables grow with the retention, by design; bloat would grow per message).

The report (the verdict, each fault and its recovery, the samples) is printed and written to
``build/soak-report.md``.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from faults import kit_apps

from outbox_inbox import Service
from outbox_inbox.testing.faultkit import FaultKit
from outbox_inbox.testing.injection import iptables_problem

pytestmark = pytest.mark.soak

ROOT = Path(__file__).resolve().parents[2]
DURATION = float(os.environ.get("OUTBOX_INBOX_SOAK_SECONDS", "3600"))
INTERVAL = 45.0
SAMPLE = 30.0
RATES = (100.0, 150.0, 200.0, 300.0)
RECOVERY_BOUND = 30.0
RSS_GROWTH = 30 * 2**20
MAX_SESSIONS = 40

#: (fault, options): what the soak draws from, each as likely as the others.
FAULTS: list[tuple[str, dict[str, Any]]] = [
    ("kill", {"role": "worker", "at": "worker.handled", "nth": 50}),
    ("kill", {"role": "receiver", "at": "receiver.stored", "nth": 20}),
    ("kill", {"role": "relay", "at": "relay.confirmed", "nth": 20}),
    ("kill", {"role": "worker"}),
    ("postgres-restart", {"seconds": 3}),
    ("rabbitmq-restart", {}),
    ("terminate-sessions", {"rounds": 3}),
    ("memory-alarm", {"seconds": 5}),
    ("disk-alarm", {"seconds": 5}),
    ("disk-full", {"database": "jobs", "table": "job_effects", "seconds": 5}),
    ("duplicate", {"times": 3, "last": 100}),
    ("clock-skew", {"produce": "kit_apps:produce", "service": "producer", "seconds": -600}),
    ("blackhole", {"server": "rabbitmq", "seconds": 10}),
    ("blackhole", {"server": "postgres", "seconds": 20}),
]


def _sample(kit: FaultKit, started: float) -> dict[str, Any]:
    with kit.postgres.connect() as conn:
        sessions = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s)", [kit.databases]
        ).fetchone()
        sizes = {
            name: conn.execute("SELECT pg_database_size(%s)", [name]).fetchone()[0]
            for name in kit.databases
        }
    amqp = kit.rabbitmq.rabbitmqctl("list_connections", "vhost", "--no-table-headers", "-q")
    return {
        "t": round(time.monotonic() - started),
        "rss": {r.name: (r.pid, _rss(r.pid)) for r in kit.roles},
        "pg_sessions": sessions[0] if sessions else 0,
        "amqp_connections": sum(1 for line in amqp.splitlines() if line.strip() == kit.vhost),
        "db_bytes": sizes,
        "stored": kit.history.count(),
    }


def _rss(pid: int | None) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return 0
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.timeout(DURATION + 900)
def test_an_hour_of_random_faults_loses_nothing_doubles_nothing_and_drifts_nowhere(
    outbox_inbox_fault_kit: FaultKit,
) -> None:
    kit = outbox_inbox_fault_kit
    kit.recovery_limit = RECOVERY_BOUND * 2
    kit.path.append(Path(kit_apps.__file__).parent)  # the role processes import kit_apps
    faults = list(FAULTS)
    if iptables_problem()[0] is None:
        faults = [f for f in faults if f[0] != "blackhole"]
    seed = int(os.environ.get("OUTBOX_INBOX_SOAK_SEED", str(time.time_ns() % 10**6)))
    draw = random.Random(seed)
    jobs_url, producer_url = kit.database("jobs"), kit.database("producer")
    jobs = kit_apps.prepare(jobs_url, kit.mq_url)
    producer = Service("producer", db_url=producer_url, mq_url=kit.mq_url)
    producer.migrate()
    kit.start("relay", service="producer", db_url=producer_url)
    kit.start("receiver", app="kit_apps:correct", db_url=jobs_url)
    kit.start("worker", app="kit_apps:correct", db_url=jobs_url)
    kit.effects(jobs_url, kit_apps.effects)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    next_sample = started
    try:
        with kit.load(producer, kit_apps.produce, rate=RATES[0]) as load:
            while time.monotonic() - started < DURATION:
                load.interval = 1.0 / draw.choice(RATES)
                deadline = time.monotonic() + INTERVAL
                while time.monotonic() < deadline:
                    if time.monotonic() >= next_sample:
                        samples.append(_sample(kit, started))
                        next_sample += SAMPLE
                    time.sleep(1.0)
                name, options = draw.choice(faults)
                kit.inject(name, **options)
            samples.append(_sample(kit, started))
    finally:
        producer.close()
        jobs.close()
    verdict = kit.check()
    report = _report(seed, verdict.report(), samples)
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "soak-report.md").write_text(report)
    print(report)
    problems = [] if verdict.valid else ["the verdict is invalid"]
    slow = [
        f"{f.name} {f.recovered_s}"
        for f in verdict.faults
        if f.recovered_s is None or f.recovered_s > RECOVERY_BOUND
    ]
    if slow:
        problems.append(f"faults not recovered from within {RECOVERY_BOUND:.0f} s: {slow}")
    problems += _drift(samples)
    assert not problems, "\n".join(problems) + "\n" + report


def _drift(samples: list[dict[str, Any]]) -> list[str]:
    problems = []
    half = samples[len(samples) // 2]
    last = samples[-1]
    for name, (pid, rss) in last["rss"].items():
        then_pid, then_rss = half["rss"].get(name, (None, 0))
        if pid == then_pid and rss - then_rss > RSS_GROWTH:
            problems.append(f"{name} (pid {pid}) grew {(rss - then_rss) / 2**20:.0f} MiB")
    most = max(s["pg_sessions"] for s in samples)
    if most > MAX_SESSIONS:
        problems.append(f"{most} PostgreSQL sessions at once (bound {MAX_SESSIONS})")
    first = next((s for s in samples if s["stored"] > 1000), None)
    if first is not None and last["stored"]:
        per_first = sum(first["db_bytes"].values()) / first["stored"]
        per_last = sum(last["db_bytes"].values()) / last["stored"]
        if per_last > 1.5 * per_first:
            problems.append(f"bytes per message grew from {per_first:.0f} to {per_last:.0f}")
    return problems


def _report(seed: int, verdict: str, samples: list[dict[str, Any]]) -> str:
    lines = [
        f"# Soak: {DURATION / 60:.0f} min, seed {seed}",
        "",
        "```",
        verdict,
        "```",
        "",
        "| t (s) | committed transactions | PG sessions | AMQP conns | DB MiB | RSS MiB (pid) |",
        "|---|---|---|---|---|---|",
    ]
    for s in samples:
        rss = ", ".join(f"{n} {r / 2**20:.0f} ({p})" for n, (p, r) in s["rss"].items())
        mib = sum(s["db_bytes"].values()) / 2**20
        lines.append(
            f"| {s['t']} | {s['stored']} | {s['pg_sessions']} | "
            f"{s['amqp_connections']} | {mib:.0f} | {rss} |"
        )
    return "\n".join(lines) + "\n"
