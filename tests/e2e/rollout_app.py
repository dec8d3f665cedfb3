"""billing before and after a deploy that adds handlers (run by test_rollout.py).

``python rollout_app.py old|new`` runs one worker process of that code until SIGTERM, with the
database and broker URLs in ``E2E_DB_URL`` / ``E2E_MQ_URL``. The old code handles version 1
of ``orders.order.placed``; the new code also version 2, and ``orders.order.cancelled``. Each
handler writes one row of ``effects`` (tests/e2e/apps.py) with the message's version as
``seq`` and this process's pid as ``handled_by``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

from sqlalchemy import text

from outbox_inbox import Message, Service

CODES = ("old", "new")
SETTINGS: dict[str, Any] = {
    "worker_poll_interval": 0.2,
    "relay_poll_interval": 0.2,
    "reconnect_initial": 0.2,
    "processes": 1,
}


def build(code: str, db_url: str, mq_url: str) -> Service:
    """billing as the `code` ("old" or "new") has it."""
    service = Service("billing", db_url=db_url, mq_url=mq_url, **SETTINGS)

    def record(message: Message, session: Any) -> None:
        session.execute(
            text(
                "INSERT INTO effects (message_id, type, key, seq, handled_by)"
                " VALUES (:m, :t, :k, :v, :pid)"
            ),
            {
                "m": message.message_id,
                "t": message.type,
                "k": message.key,
                "v": message.version,
                "pid": os.getpid(),
            },
        )

    service.on_event("orders.order.placed", version=1)(record)
    if code == "new":
        service.on_event("orders.order.placed", version=2)(record)
        service.on_event("orders.order.cancelled")(record)
    return service


def main() -> None:
    if sys.platform.startswith("linux"):  # die with the test that started us
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)
    code = sys.argv[1]
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {code}[%(process)d] %(name)s: %(message)s"
    )
    service = build(code, os.environ["E2E_DB_URL"], os.environ["E2E_MQ_URL"])
    logging.getLogger("e2e.rollout").info("entering role worker of the %s code", code)
    service.run_worker()
    service.close()


if __name__ == "__main__":
    main()
