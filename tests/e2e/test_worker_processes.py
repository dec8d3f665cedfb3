"""Worker processes: `Service.run()` (here ``apps.py run``, as ``outbox-inbox run all``) forks
its workers into one process per CPU by default and supervises them: a child SIGKILLed is
started again and its rows handled within seconds, SIGTERM stops every child after its batch,
and children whose parent died stop by themselves. Every message is handled exactly once
throughout (``effects.message_id`` is unique)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox_inbox import Service
from outbox_inbox.supervisor import available_cpus

from .harness import INBOX, Database, Processes, ServiceProcess, running, wait_until

#: The library's default number of worker processes (one per CPU), and quick polls.
SUPERVISED: dict[str, Any] = {"processes": None}


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _send(billing: Service, count: int) -> list[object]:
    with billing.session() as session, session.begin():
        return [
            billing.outbox.send(session, "billing", "ledger.append", {"seq": n})
            for n in range(count)
        ]


def _start_with_two_children(
    processes: Processes, role: str, handle_delay: float | None = None
) -> tuple[ServiceProcess, set[int]]:
    """`role` of billing with two worker processes, once both are running."""
    run = processes.start(role, settings={"processes": 2}, handle_delay=handle_delay)
    processes.wait_until(lambda: len(_children(run.pid)) == 2, timeout=30, what="2 children")
    return run, _children(run.pid)


def _states(db: Database) -> list[tuple[str, int, int, int]]:
    return sorted(
        tuple(r)
        for r in db.rows(
            f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
        )
    )


def test_run_forks_one_worker_process_per_cpu_and_they_share_the_work(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    run = processes.start("run", settings=SUPERVISED, handle_delay=0.002)
    cpus = available_cpus()
    processes.wait_until(
        lambda: len(_children(run.pid)) == cpus, timeout=30, what=f"{cpus} worker processes"
    )
    workers = _children(run.pid)
    ids = _send(billing, 600)
    processes.wait_until(lambda: db.count("effects") == 600, timeout=60, what="600 effects")
    handled_by = {pid for (pid,) in db.rows("SELECT DISTINCT handled_by FROM effects")}
    assert handled_by == workers  # every child handled some, and nothing else did
    assert sorted(m for (m,) in db.rows("SELECT message_id FROM effects")) == sorted(ids)


def test_a_worker_process_sigkilled_mid_batch_is_started_again_and_its_rows_handled_within_seconds(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    # 10 ms per message: each child is inside a batch of 50 most of the time.
    run, _ = _start_with_two_children(processes, "run", handle_delay=0.01)
    ids = _send(billing, 1000)
    processes.wait_until(lambda: db.count("effects") >= 100, timeout=30, what="100 effects")

    def victim() -> tuple[int, list[Any]]:
        for pid in sorted(_children(run.pid)):
            held = db.rows(
                f"SELECT message_id FROM {INBOX} WHERE status = 'pending'"
                " AND split_part(locked_by, ':', 2) = :pid",
                pid=str(pid),
            )
            if held:
                return pid, [m for (m,) in held]
        return 0, []

    pid, held = wait_until(lambda: (v := victim())[1] and v, timeout=10, what="a child's claims")
    survivors = _children(run.pid) - {pid}
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    processes.wait_until(
        lambda: (
            db.count(INBOX, "status = 'processed' AND message_id = ANY(:ids)", ids=held)
            == len(held)
        ),
        timeout=10,
        what="the killed child's rows to be handled",
    )
    took = time.monotonic() - killed_at
    processes.wait_until(
        lambda: len(_children(run.pid) - survivors) == 1,
        timeout=10,
        what="a new worker process",
    )
    processes.wait_until(lambda: db.count("effects") == 1000, timeout=60, what="1000 effects")
    assert took < 10
    assert sorted(m for (m,) in db.rows("SELECT message_id FROM effects")) == sorted(ids)
    # The parent names how the child ended (the line may follow the rows handled by others).
    processes.wait_until(
        lambda: f"(pid {pid}) was killed by SIGKILL" in run.log_path.read_text(),
        timeout=10,
        what="the parent to log how the child ended",
    )
    # The killed child's batch was counted once more (claimed, never finished); no row twice.
    states = dict(((s, a, f), n) for s, a, f, n in _states(db))
    assert sum(states.values()) == 1000 and {s for s, _, _ in states} == {"processed"}
    assert {f for _, _, f in states} == {1}


def test_sigterm_stops_every_worker_process_after_its_batch_and_leaves_no_counted_claim(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    run, children = _start_with_two_children(processes, "run", handle_delay=0.02)
    ids = _send(billing, 1000)
    processes.wait_until(lambda: db.count("effects") >= 100, timeout=30, what="100 effects")

    run.signal(signal.SIGTERM)
    assert run.wait(30) == 0, run.log_tail()
    assert not any(_alive(pid) for pid in children)
    # Every batch in hand was finished or given back: what is processed has its effect, and
    # no pending row carries a claim or a counted attempt it never finished.
    done = db.count(INBOX, "status = 'processed'")
    assert 100 <= done < 1000 and db.count("effects") == done
    assert (
        db.count(INBOX, "status = 'pending' AND (attempts <> finished OR locked_by IS NOT NULL)")
        == 0
    )

    again = processes.start("run", settings={"processes": 2})
    processes.wait_until(lambda: db.count("effects") == 1000, timeout=60, what="the rest")
    again.signal(signal.SIGTERM)
    assert again.wait(30) == 0, again.log_tail()
    assert _states(db) == [("processed", 1, 1, 1000)]
    assert sorted(m for (m,) in db.rows("SELECT message_id FROM effects")) == sorted(ids)


def test_worker_processes_stop_by_themselves_when_their_parent_is_sigkilled(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    with running(billing, workers=0):  # relay and receiver here: the parent's die with it
        run, children = _start_with_two_children(processes, "worker", handle_delay=0.01)
        _send(billing, 300)
        processes.wait_until(lambda: db.count("effects") >= 50, timeout=30, what="50 effects")
        run.signal(signal.SIGKILL)
        wait_until(
            lambda: not any(_alive(pid) for pid in children),
            timeout=10,
            what="the orphaned worker processes to stop",
        )
    done = db.count(INBOX, "status = 'processed'")
    assert db.count("effects") == done
    assert db.count(INBOX, "status = 'pending' AND attempts <> finished") == 0


def test_sigterm_while_the_service_starts_stops_it_within_seconds(
    db_url: str, prepare_db: Callable[[str, str], Database], processes: Processes
) -> None:
    """A SIGTERM that comes while the service checks its servers and forks its workers: the
    signal is not lost to a child that has no handler yet, and no one waits for workers that
    will never start."""
    prepare_db("billing", db_url)
    for _ in range(3):
        run = processes.start("run", settings={"processes": 2})
        processes.wait_until(run.entered_role, timeout=30, what="the service to start")
        run.signal(signal.SIGTERM)
        started = time.monotonic()
        assert run.wait(20) == 0, run.log_tail()
        assert time.monotonic() - started < 10, run.log_tail()
        assert "still running after" not in run.log_path.read_text()
