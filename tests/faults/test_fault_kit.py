"""The fault kit users run on their own services: it passes a correct service and catches bugs.

The kit's checker must go red on a real bug, not only stay green on the library's examples:

* a handler that writes its effect outside the session it is given (its own connection,
  committed at once) has that effect twice when the worker is killed after the handler ran and
  before the mark committed: the checker reports it **duplicated**;
* a producer that writes its outbox row outside the business transaction (committed on its own)
  sends the messages of transactions that rolled back: their effects are **unexpected**.

The same services written correctly pass under the same faults, and examples/billing's own
fault test (examples/billing/test_faults.py, shown in docs/testing.md) runs as a user runs it:
``python -m pytest test_faults.py`` in examples/billing, in a process of its own, on private
servers the kit's plugin starts.

Each run's role processes record their events, and the run is replayed against the model
(replay.py): the correct service's runs conform to it; the buggy handler's run has a second
effect the model forbids (``exactly-once-effect``), the buggy producer's an effect of a
transaction that rolled back (``no-effect-without-commit``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from docs.markdown_run import parse_blocks
from model.conformance import Replay, check
from sqlalchemy import func, select

from outbox_inbox import Service
from outbox_inbox.database import connect
from outbox_inbox.testing.faultkit import FaultKit
from outbox_inbox.testing.injection import iptables_problem
from outbox_inbox.testing.servers import wait_until

from . import kit_apps
from .replay import kit_run, replayed

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
Faults = list[tuple[str, dict[str, Any]]]


def _run(
    kit: FaultKit,
    *,
    app: str,
    producer: kit_apps.Produce,
    faults: Faults,
    after: Faults | None = None,
) -> None:
    """The jobs service of kit_apps (`app`) fed by a producer under `faults`, in order, and
    `after` the load. The role processes record their events in ``<workdir>/events``."""
    jobs_url, producer_url = kit.database("jobs"), kit.database("producer")
    service = kit_apps.prepare(jobs_url, kit.mq_url)
    producers = Service("producer", db_url=producer_url, mq_url=kit.mq_url)
    producers.migrate()
    events = kit.workdir / "events"
    events.mkdir()
    kit.path.append(ROOT / "tests")  # EventLog, from e2e.apps
    # every role process the kit starts, restarts included, records its events
    recording = mock.patch.dict(os.environ, {kit_apps.EVENT_LOG_ENV: str(events)})
    recording.start()
    try:
        kit.start("relay", app="kit_apps:producer", db_url=producer_url)
        kit.start("receiver", app=app, db_url=jobs_url)
        kit.start("worker", app=app, db_url=jobs_url)
        kit.effects(jobs_url, kit_apps.effects)
        with kit.load(producers, producer, rate=40, abort_every=5) as load:
            for name, options in faults:
                kit.inject(name, **options)
            wait_until(lambda: load.written >= 50, timeout=30, what="50 transactions")
        for name, options in after or []:
            kit.inject(name, **options)
    finally:
        recording.stop()
        producers.close()
        service.close()


def _replay(kit: FaultKit, name: str, *, broken: bool = False) -> Replay:
    """The run's events and tables (after `kit.check`: every effect is in) against the model;
    `broken`: a buggy service's run, expected to be rejected."""
    jobs_url, producer_url = (kit.postgres.url(d) for d in kit.databases[:2])
    events = kit.workdir / "events"
    # `kit.check` waited for the effects it knew to expect; a transaction whose commit raised
    # (unknown to the kit) may have committed a message still on its way: wait for it
    deadline = time.monotonic() + 30
    while True:
        run = kit_run(kit, name, producer_url, jobs_url, events)
        if time.monotonic() > deadline or {r for r, _ in check(run).violations} != {"finished"}:
            break
        time.sleep(1.0)
    replay = replayed(run, broken=broken)
    print(replay.report())
    return replay


def _duplicates_dropped(kit: FaultKit) -> int:
    """Deliveries the jobs receiver dropped as copies of stored messages."""
    jobs = connect(kit.postgres.url(kit.databases[0]))
    try:
        with jobs.engine.connect() as conn:
            return int(
                conn.scalar(select(func.coalesce(func.sum(jobs.tables.deliveries.c.duplicates), 0)))
            )
    finally:
        jobs.engine.dispose()


def test_a_correct_service_passes_the_kit(outbox_inbox_fault_kit: FaultKit) -> None:
    kit = outbox_inbox_fault_kit
    skewed = {"produce": "kit_apps:produce", "service": "producer", "count": 10}
    faults: Faults = [
        ("kill", {"role": "worker", "at": "worker.handled", "nth": 5}),
        ("duplicate", {"times": 3, "last": 20}),
        ("clock-skew", {**skewed, "seconds": -600}),
        ("clock-skew", {**skewed, "seconds": 600}),
        ("disk-full", {"database": "jobs", "table": "job_effects", "seconds": 3}),
        ("disk-alarm", {"seconds": 3}),
        ("terminate-sessions", {"rounds": 2}),
        ("memory-alarm", {"seconds": 2}),
        *([("blackhole", {"server": "rabbitmq", "seconds": 5})] if iptables_problem()[0] else []),
    ]
    _run(kit, app="kit_apps:correct", producer=kit_apps.produce_keyed, faults=faults)
    verdict = kit.check()
    print(verdict.report())
    assert verdict.valid, verdict.report()
    assert verdict.committed > 20 and verdict.transactions["failed"] > 0
    assert all(f.recovered_s is not None for f in verdict.faults), verdict.report()
    # The copies really reached the receiver, and the inbox dropped them.
    assert _duplicates_dropped(kit) >= 3 * 20
    replay = _replay(kit, "kit: a correct service")
    assert replay.conforms, replay.report()
    # the worker killed after a handler ran: a run without a sequel, explained by the kill
    assert replay.premises["run-ends"] >= 1 and replay.premises["key-order"] > 0
    assert replay.premises["dead-sends-its-fault"] >= 1  # the refused jobs


def test_a_handler_writing_its_effect_outside_the_session_is_caught_as_duplicated(
    outbox_inbox_fault_kit: FaultKit,
) -> None:
    kit = outbox_inbox_fault_kit
    kill: Faults = [("kill", {"role": "worker", "at": "worker.handled", "nth": 5})]
    _run(kit, app="kit_apps:outside_the_session", producer=kit_apps.produce_keyed, faults=kill)
    verdict = kit.check()
    print(verdict.report())
    assert not verdict.valid
    assert verdict.duplicated, verdict.report()
    assert not verdict.lost and not verdict.unexpected, verdict.report()
    replay = _replay(kit, "kit: effect outside the session", broken=True)
    assert "exactly-once-effect" in {rule for rule, _ in replay.violations}


def test_a_producer_writing_its_outbox_row_outside_the_transaction_is_caught_as_unexpected(
    outbox_inbox_fault_kit: FaultKit,
) -> None:
    kit = outbox_inbox_fault_kit
    _run(kit, app="kit_apps:correct", producer=kit_apps.produce_outside, faults=[])
    verdict = kit.check()
    print(verdict.report())
    assert not verdict.valid
    assert verdict.unexpected, verdict.report()
    assert not verdict.lost and not verdict.duplicated, verdict.report()
    # It never killed its worker after a handler ran: refused, whatever it found.
    assert any("kill at worker.handled" in reason for reason in verdict.refused)
    replay = _replay(kit, "kit: outbox row outside the transaction", broken=True)
    assert "no-effect-without-commit" in {rule for rule, _ in replay.violations}
    assert not replay.counts  # no fault injected


def test_a_run_whose_only_fault_lies_outside_its_load_is_refused(
    outbox_inbox_fault_kit: FaultKit,
) -> None:
    kit = outbox_inbox_fault_kit
    outside: Faults = [("kill", {"role": "receiver"})]
    _run(kit, app="kit_apps:correct", producer=kit_apps.produce_keyed, faults=[], after=outside)
    verdict = kit.check()
    print(verdict.report())
    assert not (verdict.lost or verdict.duplicated or verdict.unexpected), verdict.report()
    assert not verdict.valid
    assert (
        "fault kill did not overlap the load (nothing written before its end, or nothing"
        " committed after it): inject it inside `with kit.load(...)`"
    ) in verdict.refused
    replay = _replay(kit, "kit: a kill after the load")
    assert replay.conforms, replay.report()


def test_the_billing_example_passes_its_own_fault_test_as_docs_testing_md_shows_it() -> None:
    """docs/testing.md shows examples/billing/test_faults.py whole and the command that runs it:
    the page's file is the example's, and its command passes, in a process of its own."""
    page = ROOT / "docs" / "testing.md"
    blocks = [
        b
        for b in parse_blocks(page.read_text())
        if b.marker("run by") == "tests/faults/test_fault_kit.py"
    ]
    [code] = [b.text for b in blocks if b.lang == "python"]
    [console] = [b.text for b in blocks if b.lang == "console"]
    example = ROOT / "examples" / "billing" / "test_faults.py"
    assert code == example.read_text()
    command = console.splitlines()[0].removeprefix("$ ")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        shlex.split(command),
        cwd=example.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "1 passed" in output and "valid: transactions" in output, output[-3000:]
