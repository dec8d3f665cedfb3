"""At-most-once handlers on PostgreSQL with a real worker process that kills itself in the
handler: `at_most_once` loses the message (processed, its effect absent), `one_attempt` ends it
dead (`interrupted`); neither runs it twice. An error (not a crash) in each mode too."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from helpers import make_service, received_row, rows, running, scalar, wait_until
from outbox_inbox import Message
from outbox_inbox.queries import roles

APP = Path(__file__).with_name("at_most_once_app.py")
ROOT = Path(__file__).resolve().parents[2]
RUN, PLAIN = "billing.job.run", "billing.job.plain"


def _store(db_url: str, jobs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    service = make_service("billing", db_url, None)
    stored = [received_row(routing_key=key, payload=payload) for key, payload in jobs]
    with service.engine.begin() as conn:
        roles.insert_inbox(conn, service.tables, stored)
    service.close()
    return [str(r["message_id"]) for r in stored]


def _pending(db_url: str) -> int:
    query = "SELECT count(*) FROM outbox_inbox.inbox_messages WHERE status = 'pending'"
    return int(scalar(db_url, query))


@pytest.mark.parametrize(
    ("delivery", "died", "failed"),
    [
        ("at_most_once", ("processed", None), ("processed", None)),
        ("one_attempt", ("dead", "interrupted"), ("dead", "max_attempts")),
    ],
)
def test_a_handler_that_kills_its_worker_or_fails_runs_once(
    db_url: str, tmp_path: Path, delivery: str, died: tuple[Any], failed: tuple[Any]
) -> None:
    runs = tmp_path / "runs"
    runs.touch()
    (fail_id,) = _store(db_url, [(RUN, {"fail": True})])
    kills, worker = 0, None
    log = open(tmp_path / "worker.log", "ab")  # noqa: SIM115 - the worker's lifetime

    def start() -> subprocess.Popen[bytes]:
        command = [sys.executable, str(APP), delivery, db_url, str(runs)]
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)

    try:
        worker = start()
        wait_until(lambda: _pending(db_url) == 0, timeout=30, what="the failing message")
        # The next ones in one batch: the one that kills its worker amid exactly-once ones.
        jobs = [(PLAIN, {"n": 1}), (RUN, {"die": True}), (PLAIN, {"n": 2}), (RUN, {"n": 3})]
        plain1, die_id, plain2, after_id = _store(db_url, jobs)
        deadline = time.monotonic() + 60
        while _pending(db_url) and time.monotonic() < deadline:
            if worker.poll() is not None:  # a supervisor's job: start it again
                assert worker.returncode == -signal.SIGKILL
                kills += 1
                worker = start()
            time.sleep(0.1)
        assert _pending(db_url) == 0
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        if worker is not None:
            worker.wait(10)
        log.close()
    states = dict(
        rows(
            db_url,
            "SELECT message_id::text, ARRAY[status, dead_reason] FROM outbox_inbox.inbox_messages",
        )
    )
    effects = {m for (m,) in rows(db_url, "SELECT message_id FROM effects")}
    ran = Counter(runs.read_text().split())
    assert kills == 1
    assert ran[die_id] == ran[fail_id] == 1  # never twice
    assert tuple(states[die_id]) == died and tuple(states[fail_id]) == failed
    assert die_id not in effects and fail_id not in effects
    assert {plain1, plain2} <= effects  # the exactly-once neighbours are handled
    assert states[plain1] == states[plain2] == ["processed", None]
    # The one claimed with it: at_most_once settled it before the kill (lost if it had not
    # run yet); one_attempt ends it dead if its claim was cut short, else it ran.
    assert ran[after_id] <= 1


def test_one_attempt_whose_database_fails_in_the_handler_is_not_given_back_to_run_again(
    db_url: str,
) -> None:
    # A statement failing because the database cannot work now (disk full) is no handler
    # failure: the batch's claims are given back uncounted, to be run again. Not a one-attempt
    # row's: it ran, so it stays counted and ends interrupted; its exactly-once batch-mate runs
    # again and is processed.
    svc = make_service("billing", db_url, None)
    ran: Counter[str] = Counter()
    disk_full = text("DO $$ BEGIN RAISE EXCEPTION 'no space' USING ERRCODE = 'disk_full'; END $$")

    def handle(message: Message, session: Any) -> None:
        ran[str(message.message_id)] += 1
        if message.payload.get("full") and ran[str(message.message_id)] == 1:
            session.execute(disk_full)

    svc.on_command("job.run", delivery="one_attempt")(handle)
    svc.on_command("job.plain")(handle)
    once_id, plain_id = _store(db_url, [(RUN, {"full": True}), (PLAIN, {"full": True})])
    with running(svc.worker()):
        wait_until(lambda: _pending(db_url) == 0, timeout=30, what="both rows finished")
    svc.close()
    states = dict(
        rows(db_url, "SELECT message_id::text, dead_reason FROM outbox_inbox.inbox_messages")
    )
    assert ran[once_id] == 1 and states[once_id] == "interrupted"
    assert states[plain_id] is None


def test_async_handlers_at_most_once_on_the_asyncio_worker(db_url: str) -> None:
    svc = make_service("billing", db_url, None)
    seen: dict[str, str] = {}
    inbox = svc.tables.inbox

    @svc.on_command("job.run", delivery="at_most_once")
    async def settled(message: Message, session: AsyncSession) -> None:
        status = select(inbox.c.status).where(inbox.c.message_id == message.message_id)
        seen[str(message.message_id)] = (await session.execute(status)).scalar_one()
        if message.payload.get("fail"):
            raise RuntimeError("the handler failed")

    @svc.on_command("job.plain", delivery="one_attempt")
    async def once(message: Message, session: AsyncSession) -> None:
        seen[str(message.message_id)] = "ran"
        raise RuntimeError("the handler failed")

    ok_id, lost_id, dead_id = _store(db_url, [(RUN, {}), (RUN, {"fail": True}), (PLAIN, {})])
    stop = threading.Event()
    thread = threading.Thread(target=svc.async_worker().run_in_thread, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: _pending(db_url) == 0, timeout=30, what="the rows finished")
    finally:
        stop.set()
        thread.join(20)
    svc.close()
    states = dict(
        rows(db_url, "SELECT message_id::text, dead_reason FROM outbox_inbox.inbox_messages")
    )
    assert seen == {ok_id: "processed", lost_id: "processed", dead_id: "ran"}
    assert states == {ok_id: None, lost_id: None, dead_id: "max_attempts"}
