"""Several relays and workers on one service database: exactly once, and in key order."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Callable

from outbox_inbox import Service

from .harness import INBOX, OUTBOX, Database, Processes, hold


def test_two_relays_two_workers_5000_messages_exactly_once_in_key_order(
    db_url: str,
    make_service: Callable[..., Service],
    prepare_db: Callable[[str, str], Database],
    processes: Processes,
) -> None:
    # More keys than two batches hold: a worker claims its next batch in the transaction that
    # marks the current one, and takes only keys nobody holds, so with no more keys than a
    # batch one worker can keep every key in hand from batch to batch and the other none.
    keys, per_key, per_transaction, writer_count = 125, 40, 2, 5
    total = keys * per_key
    db = prepare_db("billing", db_url)
    billing = make_service("billing", db_url)
    billing.declare_topology()

    relay_settings = {"relay_batch_size": 100}
    worker_settings = {"worker_batch_size": 50, "lease": 60}
    relays = [
        processes.start("relay", settings=relay_settings, record_relayed=True) for _ in range(2)
    ]
    processes.start("receiver")
    workers = [processes.start("worker", settings=worker_settings) for _ in range(2)]
    processes.wait_started()  # so that no relay or worker has the work to itself by being first

    # Written while the roles run, by concurrent writers that each own some keys (a key's
    # order is its one writer's commit order). Each transaction takes the next seqs of its
    # writer's keys in a new random order, so the ids of the keys interleave.
    key_names = [f"account-{k:03d}" for k in range(keys)]
    errors: list[BaseException] = []

    def write(own: list[str], seed: int) -> None:
        rng = random.Random(seed)
        try:
            for first in range(0, per_key, per_transaction):
                with billing.session() as session, session.begin():
                    for key in rng.sample(own, len(own)):
                        for seq in range(first, first + per_transaction):
                            billing.outbox.send(
                                session, "billing", "ledger.append", {"seq": seq}, key=key
                            )
        except BaseException as exc:
            errors.append(exc)

    writers = [
        threading.Thread(target=write, args=(key_names[n::writer_count], n), daemon=True)
        for n in range(writer_count)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert not any(w.is_alive() for w in writers) and not errors, errors

    processes.wait_until(
        lambda: db.count("effects") >= total,
        timeout=150,
        interval=0.5,
        what="every message to be handled",
        describe=lambda: (db.count("relayed"), db.count(INBOX), db.count("effects")),
    )
    hold(1.0, lambda: db.count("effects") == total, what="one effect per message")

    # Exactly once: each message committed as published by one relay, stored once, handled
    # once (a second run of a handler would have failed on effects' unique message_id and left
    # finished > 1 or a dead row).
    assert db.scalar("SELECT count(DISTINCT message_id) FROM relayed") == total
    assert db.count("relayed") == total
    assert db.rows(
        f"SELECT status, attempts, finished, count(*) FROM {INBOX} GROUP BY 1, 2, 3"
    ) == [("processed", 1, 1, total)]
    # Both relays and both workers took part.
    relay_share = dict(db.rows("SELECT relay_pid, count(*) FROM relayed GROUP BY 1"))
    assert set(relay_share) == {r.pid for r in relays}, relay_share
    worker_share = dict(db.rows("SELECT handled_by, count(*) FROM effects GROUP BY 1"))
    assert set(worker_share) == {w.pid for w in workers}, worker_share

    # Key order. The workers must handle each key in the order its messages were received
    # (inbox ids); the relays and the receiver must receive each key in commit order (seq).
    # Checked in that order, so that a relay's mistake does not hide a worker's.
    received: dict[str, list[int]] = defaultdict(list)
    for key, seq in db.rows(f"SELECT key, (payload->>'seq')::int FROM {INBOX} ORDER BY id"):
        received[key].append(seq)
    handled: dict[str, list[int]] = defaultdict(list)
    for key, seq in db.rows("SELECT key, seq FROM effects ORDER BY handled_order"):
        handled[key].append(seq)
    assert sorted(received) == sorted(handled) == key_names
    mishandled = sorted(k for k in key_names if handled[k] != received[k])
    assert mishandled == [], _history(db, mishandled, handled)
    expected = list(range(per_key))
    misreceived = sorted(k for k in key_names if received[k] != expected)
    assert misreceived == [], _history(db, misreceived, received)


def _history(db: Database, keys: list[str], seen: dict[str, list[int]]) -> str:
    """What happened to the messages around the first inversion of each key in `keys`."""
    lines = [f"{len(keys)} keys out of order: {keys}"]
    for key in keys[:3]:
        order = seen[key]
        first = next((n for n in range(len(order) - 1) if order[n] > order[n + 1]), 0)
        window = order[max(first - 2, 0) : first + 4]
        lines.append(f"key {key}, seen as ...{window}...")
        lines.append(
            "  seq outbox_id attempts relay_pid batch position confirmed_at committed_at inbox_id"
        )
        for row in db.rows(
            "SELECT (o.payload->>'seq')::int AS seq, o.id, o.attempts, r.relay_pid, r.batch,"
            " r.position, r.confirmed_at, r.committed_at, i.id"
            f" FROM {OUTBOX} o LEFT JOIN relayed r USING (message_id)"
            f" LEFT JOIN {INBOX} i USING (message_id) WHERE o.key = :key ORDER BY o.id",
            key=key,
        ):
            if row.seq in window:
                lines.append("  " + " ".join(str(v) for v in row))
    return "\n".join(lines)
