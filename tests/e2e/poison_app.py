"""A service whose handler kills its own process on a poison message (run by test_poison.py).

python poison_app.py worker|receiver|receiver-dying-in-decode DB_URL MQ_URL

``receiver-dying-in-decode`` is the receiver with a fault injected into its decoding step: the
decoding of a delivery whose body holds ``die_in_decode`` SIGKILLs the process, as a decoder
that crashes the interpreter or runs out of memory would.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

from sqlalchemy import text

from outbox_inbox import Message, Service

SETTINGS: dict[str, Any] = {
    "lease": 1.5,
    "abandon_after": 2,
    "worker_batch_size": 10,
    "worker_poll_interval": 0.1,
    "max_redeliveries": 2,
    "reconnect_initial": 0.1,
    "processes": 1,  # the test kills and restarts this one process itself
}


def build(db_url: str, mq_url: str) -> Service:
    service = Service("billing", db_url=db_url, mq_url=mq_url, **SETTINGS)

    @service.on_command("job.run")
    def run(message: Message, session: Any) -> None:
        if message.payload.get("poison"):
            os.kill(os.getpid(), signal.SIGKILL)
        session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'job')"),
            {"m": str(message.message_id)},
        )

    return service


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the test that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the prctl
            os._exit(1)


def _die_in_decode() -> None:
    from outbox_inbox import receiver

    decode = receiver.from_wire

    def dying(message: Any, **options: Any) -> Any:
        if b"die_in_decode" in message.body:
            os.kill(os.getpid(), signal.SIGKILL)
        return decode(message, **options)

    receiver.from_wire = dying  # type: ignore[assignment]


def main() -> None:
    _die_with_parent()
    role, db_url, mq_url = sys.argv[1:4]
    service = build(db_url, mq_url)
    if role == "receiver-dying-in-decode":
        _die_in_decode()
        role = "receiver"
    if role == "worker":
        service.run_worker()
    else:
        service.run_receiver()


if __name__ == "__main__":
    main()
