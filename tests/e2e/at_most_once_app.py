"""A worker whose at-most-once handler kills its own process (run by test_at_most_once.py).

python at_most_once_app.py DELIVERY DB_URL RUNS_FILE

``billing.job.run`` is handled with ``delivery=DELIVERY``; ``billing.job.plain`` exactly once.
Each handler call first appends its message id to RUNS_FILE (outside any transaction, so the
line outlives a kill), writes its effect in the session, then SIGKILLs the process on a
payload with ``die`` or raises on one with ``fail``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from sqlalchemy import text

from outbox_inbox import Message, Service

SETTINGS: dict[str, Any] = {
    "worker_batch_size": 10,
    "worker_poll_interval": 0.1,
    "reconnect_initial": 0.1,
    "processes": 1,  # the test kills and restarts this one process itself
}


def build(db_url: str, delivery: Any, runs: str) -> Service:
    service = Service("billing", db_url=db_url, **SETTINGS)

    def handle(message: Message, session: Any) -> None:
        with open(runs, "a") as f:
            f.write(f"{message.message_id}\n")
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'job')"),
            {"m": str(message.message_id)},
        )
        if message.payload.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        if message.payload.get("fail"):
            raise RuntimeError("the handler failed")

    service.on_command("job.run", delivery=delivery)(handle)
    service.on_command("job.plain")(handle)
    return service


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    from poison_app import _die_with_parent

    _die_with_parent()
    delivery, db_url, runs = sys.argv[1:4]
    build(db_url, delivery, runs).run_worker()
