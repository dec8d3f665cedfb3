"""A fault test's run, read for the model's checker (tests/model/conformance.py).

The events are the role processes' (their `EventLog`, one file per process in the run's
directory); what has no hook is read from the tables once the run is over: the business
transaction's commit (the producer's outbox row, and the fault kit's history where a
transaction rolled back), the relay's mark (``published_at``), the worker's claims
(``attempts``), each inbox row's final status and dead reason, the receiver's delivery counts,
and the effects. Every replayed run is kept in
`REPLAYED` for the table conftest.py prints at the end of the session.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

from model.conformance import Message, Replay, Run, check, read_events
from sqlalchemy import create_engine, select
from sqlalchemy.pool import NullPool

from outbox_inbox.database import connect
from outbox_inbox.faults import is_fault
from outbox_inbox.testing.checker import FAILED
from outbox_inbox.testing.faultkit import FaultKit

#: Every run replayed in this session, in order.
REPLAYED: list[Replay] = []


def _tables(producer_url: str, consumer_url: str) -> list[list[Any]]:
    """The producer's outbox rows, the consumer's inbox rows, the consumer's outbox rows and
    its receiver's delivery counts."""
    rows = []
    for url, name in (
        (producer_url, "outbox"),
        (consumer_url, "inbox"),
        (consumer_url, "outbox"),
        (consumer_url, "deliveries"),
    ):
        database = connect(url)
        try:
            table = getattr(database.tables, name)
            with database.engine.connect() as conn:
                rows.append(list(conn.execute(select(table)).mappings()))
        finally:
            database.engine.dispose()
    return rows


def read_run(
    name: str,
    faults: Iterable[str],
    events: Path,
    *,
    producer_url: str,
    consumer_url: str,
    effects: Callable[[list[Any]], Counter[str]],
    rolled_back: Callable[[Any], bool] = lambda row: False,
) -> Run:
    """The run `name`: its faults, the events in `events`, and every message of the producer's
    outbox with the consumer's inbox row of it. `effects(inbox rows)` counts each message's
    effects; `rolled_back(outbox row)` says whether its business transaction rolled back."""
    outbox, inbox, sent, deliveries = _tables(producer_url, consumer_url)
    counts = {str(row["message_id"]): row["deliveries"] for row in deliveries}
    by_id = {str(row["message_id"]): row for row in inbox}
    counted = effects(inbox)
    sent_faults = Counter(
        str(row["payload"]["message_id"]) for row in sent if is_fault(row["routing_key"])
    )
    messages = {}
    for row in outbox:
        mid = str(row["message_id"])
        stored = by_id.get(mid)
        messages[mid] = Message(
            order=row["id"],
            key=row["key"],
            committed=not rolled_back(row),
            published=row["published_at"] is not None,
            status=None if stored is None else stored["status"],
            attempts=0 if stored is None else stored["attempts"],
            finished=0 if stored is None else stored["finished"],
            effects=counted[mid],
            command=row["kind"] == "command",
            faults=sent_faults[mid],
            dead_reason=None if stored is None else stored["dead_reason"],
            deliveries=counts.get(mid, 0),
        )
    return Run(name, tuple(faults), messages, read_events(events))


def replayed(run: Run, *, broken: bool = False) -> Replay:
    """Check `run`, keep its verdict for the session's table, and return it. A `broken` run
    (a buggy service's, which the test expects rejected) is shown apart from the others."""
    replay = check(run)
    replay.broken = broken
    REPLAYED.append(replay)
    return replay


def effects_by_message_id(url: str) -> Callable[[list[Any]], Counter[str]]:
    """The effects of tests/e2e/apps.py's handlers: rows of ``effects`` by message id."""

    def read(inbox: list[Any]) -> Counter[str]:
        engine = create_engine(url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                rows = conn.exec_driver_sql("SELECT message_id FROM effects").all()
        finally:
            engine.dispose()
        return Counter(str(m) for (m,) in rows)

    return read


def kit_run(kit: FaultKit, name: str, producer_url: str, jobs_url: str, events: Path) -> Run:
    """A run of test_fault_kit.py: the jobs service's effects are job numbers (payload ``n``),
    and a transaction the kit's history says failed (rolled back on purpose, or before its
    commit) did not commit, even if its outbox row is there."""
    failed: set[Hashable] = set()
    for outcome, expects in kit.history.transactions():
        if outcome == FAILED:
            failed.update(expects)

    def effects(inbox: list[Any]) -> Counter[str]:
        engine = create_engine(jobs_url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                found = Counter(n for (n,) in conn.exec_driver_sql("SELECT n FROM job_effects"))
        finally:
            engine.dispose()
        # effects of jobs no inbox row holds are kept under their number: they have no message
        ids = {row["payload"]["n"]: str(row["message_id"]) for row in inbox}
        return Counter({ids.get(n, f"job {n}"): count for n, count in found.items()})

    return read_run(
        name,
        (f.name for f in kit.history.faults),
        events,
        producer_url=producer_url,
        consumer_url=jobs_url,
        effects=effects,
        rolled_back=lambda row: row["payload"]["n"] in failed,
    )
