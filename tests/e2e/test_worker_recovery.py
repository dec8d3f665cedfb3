"""Workers that die, and workers that hang: another worker takes over as soon as it may.

A worker's claims are free as soon as its database session is gone (SIGKILL), not when the
lease runs out; a worker that is alive but hung keeps them until the lease ends. The workers run
as processes with the library's default lease (60 s), poll interval (0.5 s) and batch size (50)
unless a test says otherwise, so a bound far shorter than the lease can only hold if the dead
worker's claims are free at once, and one shorter than a poll interval per orphan only if the
orphans it left are handled without waiting between them.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from outbox_inbox import Service
from outbox_inbox.config import Settings

from .harness import INBOX, Database, Processes, ServiceProcess, hold, running, wait_until

_DEFAULTS = Settings()
#: The library's defaults for what decides when a claim is free and how fast a worker polls
#: (apps.py would otherwise give the workers its faster test settings).
DEFAULT_WORKER: dict[str, Any] = {
    "lease": _DEFAULTS.lease,
    "worker_poll_interval": _DEFAULTS.worker_poll_interval,
    "worker_batch_size": _DEFAULTS.worker_batch_size,
    "abandon_after": _DEFAULTS.abandon_after,
}


def _read_marker(path: Path) -> dict[str, Any]:
    content: dict[str, Any] = json.loads(path.read_text())
    return content


def _send(billing: Service, payloads: list[dict[str, Any]]) -> list[object]:
    """Commit one command to billing itself per payload, in one transaction; their ids."""
    with billing.session() as session, session.begin():
        return [billing.outbox.send(session, "billing", "ledger.append", p) for p in payloads]


def _kill(process: ServiceProcess) -> None:
    process.signal(signal.SIGKILL)
    assert process.wait(10) == -signal.SIGKILL


def _inbox_states(db: Database) -> list[tuple[str, int, int, int]]:
    return sorted(
        tuple(r)
        for r in db.rows(
            f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
        )
    )


def _claims(db: Database) -> list[tuple[Any, ...]]:
    """Who holds the pending claims, how many, and for how much longer."""
    return [
        tuple(r)
        for r in db.rows(
            f"SELECT locked_by, count(*),"
            f" round(extract(epoch FROM max(locked_until) - now())::numeric, 1)"
            f" FROM {INBOX} WHERE status = 'pending' AND locked_by IS NOT NULL GROUP BY 1"
        )
    ]


def test_worker_killed_ten_times_while_3000_messages_flow_handles_each_once_within_seconds(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    total, burst, kills = 3000, 100, 10
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    written: list[int] = []
    writer_error: list[BaseException] = []

    def write() -> None:
        # Bursts spread over the whole time the workers are being killed.
        try:
            for n in range(0, total, burst):
                _send(billing, [{"seq": seq} for seq in range(n, n + burst)])
                written.append(n + burst)
                time.sleep(0.8)
        except BaseException as exc:
            writer_error.append(exc)

    # A short sleep per handler call keeps the worker inside a batch for much of the time, so
    # that kills land between a claim and its commit.
    def start_worker() -> ServiceProcess:
        return processes.start("worker", settings=DEFAULT_WORKER, handle_delay=0.005)

    orphaned: list[int] = []  # claimed rows each killed worker left behind
    last_kill = time.monotonic()
    writer = threading.Thread(target=write, name="e2e-writer", daemon=True)
    # The relay and the receiver run here; only the workers run in their own processes.
    with running(billing, workers=0):
        worker = start_worker()
        processes.wait_started()
        writer.start()
        try:
            for _ in range(kills):
                time.sleep(rng.uniform(0.5, 3.0))
                _kill(worker)
                last_kill = time.monotonic()
                orphaned.append(db.count(INBOX, "status = 'pending' AND locked_by IS NOT NULL"))
                worker = start_worker()
                processes.wait_started()
        finally:
            writer.join(timeout=60)
        assert not writer.is_alive() and not writer_error, writer_error

        processes.wait_until(
            lambda: db.count("effects") >= total,
            timeout=max(last_kill + 15 - time.monotonic(), 0.1),
            what=f"every message to be handled within 15 s of the last kill (seed {seed})",
            describe=lambda: (
                written[-1:],
                _inbox_states(db),
                db.count("effects"),
                orphaned,
                _claims(db),
                db.sessions(),
            ),
        )
        hold(1.0, lambda: db.count("effects") == total, what="one effect per message")

    assert db.scalar("SELECT count(DISTINCT seq) FROM effects") == total
    # No handler ever failed (a second run of a handled message would hit effects' unique key
    # and count a finished attempt) and nothing is dead.
    assert db.rows(f"SELECT status, finished, count(*) FROM {INBOX} GROUP BY 1, 2") == [
        ("processed", 1, total)
    ]
    # The kills really hit workers holding claims (else the test proved nothing).
    assert any(orphaned), (seed, orphaned)


#: The handlers of the batch tests: called per message, and one batch handler per claimed batch
#: (the same effects, one INSERT per batch, killed or hung inside the batch handler).
HANDLERS = pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])


@HANDLERS
def test_worker_killed_holding_a_batch_of_50_is_finished_by_another_worker_within_seconds(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
    tmp_path: Path,
    batch: bool,
) -> None:
    size = DEFAULT_WORKER["worker_batch_size"]
    assert size == 50
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    marker = tmp_path / "hanging"
    options = {"settings": DEFAULT_WORKER, "hang_marker": marker, "batch": batch}

    with running(billing, workers=0):
        message_ids = _send(billing, [{"seq": n} for n in range(size)])
        wait_until(lambda: db.count(INBOX) == size, timeout=30, what="the inbox to fill")
        # Its first handler call hangs: the worker holds the whole batch, claimed and locked.
        first = processes.start("worker", **options)
        processes.wait_until(marker.exists, timeout=30, what="the first worker to hang")
        hung = _read_marker(marker)
        assert hung["pid"] == first.pid
        assert (
            db.count(
                INBOX,
                "status = 'pending' AND locked_by = :claimant AND attempts = 1",
                claimant=hung["locked_by"],
            )
            == size
        )
        second = processes.start("worker", **options)
        processes.wait_started()
        # While the first worker lives, its claims are its own.
        hold(2.0, lambda: db.count("effects") == 0, what="no effect while the holder lives")

        _kill(first)
        killed_at = time.monotonic()
        processes.wait_until(
            lambda: db.count("effects") == size,
            timeout=10,
            what="the second worker to handle the dead worker's batch within 10 s",
            describe=lambda: (_inbox_states(db), db.count("effects"), _claims(db), db.sessions()),
        )
        took = time.monotonic() - killed_at
        hold(1.0, lambda: db.count("effects") == size, what="one effect per message")

    assert took < 10
    effects = db.rows("SELECT message_id, handled_by FROM effects")
    assert sorted(m for m, _ in effects) == sorted(message_ids)
    assert {pid for _, pid in effects} == {second.pid}
    # Each was claimed twice and finished once: the second worker ran each orphan alone and
    # released the others of its claim without counting them.
    assert _inbox_states(db) == [("processed", 2, 1, size)]


@HANDLERS
def test_worker_killed_on_a_batch_of_50_with_a_poison_finishes_the_49_and_abandons_the_poison(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
    batch: bool,
) -> None:
    size, poison_at = DEFAULT_WORKER["worker_batch_size"], 10
    abandon_after = DEFAULT_WORKER["abandon_after"]
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    payloads: list[dict[str, Any]] = [{"seq": n} for n in range(size)]
    payloads[poison_at]["poison"] = True  # its handler SIGKILLs the worker process

    with running(billing, workers=0):
        message_ids = _send(billing, payloads)
        poison_id = message_ids[poison_at]
        wait_until(lambda: db.count(INBOX) == size, timeout=30, what="the inbox to fill")
        kills = 0
        started_at = time.monotonic()
        worker = processes.start("worker", settings=DEFAULT_WORKER, batch=batch)
        # A supervisor's job: start the worker again whenever it dies. The first worker claims
        # the whole batch at once (it is all in the inbox): the poison kills it in the batch.
        while db.count(INBOX, "status = 'pending'") and time.monotonic() - started_at < 20:
            if not worker.alive():
                assert worker.popen.returncode == -signal.SIGKILL, worker.log_tail()
                worker.signalled = True  # its death was expected
                kills += 1
                worker = processes.start("worker", settings=DEFAULT_WORKER, batch=batch)
            time.sleep(0.1)
        took = time.monotonic() - started_at
        # Far below the 60 s lease, with four worker processes started one after another; a
        # poll interval (0.5 s) per orphan would take 25 s.
        assert not db.count(INBOX, "status = 'pending'"), (
            f"rows still pending after {took:.0f}s (kills: {kills}): {_inbox_states(db)}"
        )

    # billing sent the batch to itself: the abandoned poison's fault comes back to billing,
    # once, and is handled like any message (outbox_inbox.faults).
    faults = db.rows(
        f"SELECT status, payload FROM {INBOX} WHERE routing_key LIKE 'billing.fault.%'"
    )
    assert [(status, payload["reason"]) for status, payload in faults] == [
        ("processed", "abandoned")
    ], faults
    states = {
        m: (status, reason, attempts, finished)
        for m, status, reason, attempts, finished in db.rows(
            f"SELECT message_id, status, dead_reason, attempts, finished FROM {INBOX}"
            " WHERE routing_key NOT LIKE 'billing.fault.%'"
        )
    }
    # Run in the batch, then alone at each of its next unfinished claims: abandoned at the
    # claim after `abandon_after` unfinished ones, which does not run it.
    assert states[poison_id] == ("dead", "abandoned", abandon_after + 1, 0), (
        states[poison_id],
        processes.describe(),
    )
    assert kills == abandon_after
    mates = {m: s for m, s in states.items() if m != poison_id}
    assert {(status, finished) for status, _, _, finished in mates.values()} == {("processed", 1)}
    effects = [m for (m,) in db.rows("SELECT message_id FROM effects")]
    assert sorted(effects) == sorted(mates)  # exactly once each, the poison never


def test_alive_but_hung_worker_keeps_its_rows_until_the_lease_ends(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
    tmp_path: Path,
) -> None:
    lease = 4.0
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    settings = {**DEFAULT_WORKER, "lease": lease}
    marker = tmp_path / "hanging"

    with running(billing, workers=0):
        # Both workers are up before the message exists: whichever claims it hangs in its
        # handler, alive, and the other polls all along.
        workers = [
            processes.start("worker", settings=settings, hang_marker=marker) for _ in range(2)
        ]
        processes.wait_started()
        (message_id,) = _send(billing, [{"seq": 1}])
        processes.wait_until(marker.exists, timeout=30, what="a worker to hang in the handler")
        hung = _read_marker(marker)
        assert hung["message_id"] == str(message_id)
        (other,) = [w for w in workers if w.pid != hung["pid"]]
        lease_end = datetime.fromisoformat(str(hung["locked_until"]))
        before_end = (lease_end - db.scalar("SELECT now()")).total_seconds() - 0.3
        hold(
            before_end,
            lambda: db.count("effects") == 0 and all(w.alive() for w in workers),
            what="the hung worker keeping its row while its lease lasts",
        )
        processes.wait_until(
            lambda: db.count("effects") == 1,
            timeout=lease + 15,
            what="the other worker to handle the message after the lease",
        )
        hold(1.0, lambda: db.count("effects") == 1, what="one effect")
        assert all(w.alive() for w in workers)  # the hung one still hangs

    ((handled_by, handled_at),) = db.rows("SELECT handled_by, handled_at FROM effects")
    assert handled_by == other.pid
    assert handled_at >= lease_end  # judged on the database clock
    assert db.rows(f"SELECT status, attempts, finished, locked_by FROM {INBOX}") == [
        ("processed", 2, 1, None)
    ]
