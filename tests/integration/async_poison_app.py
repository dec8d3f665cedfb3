"""A service whose async handler writes its effect, then kills its process on a poison message.

Run by test_async_crash.py: python async_poison_app.py DB_URL MQ_URL. The worker runs as a task
of ``run_async()``; the process dies with the batch's transaction open.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from outbox_inbox import Message, Service

SETTINGS = {
    "abandon_after": 2,
    "worker_batch_size": 10,
    "worker_poll_interval": 0.1,
    "reconnect_initial": 0.1,
    "processes": 1,  # the test kills and restarts this one process itself
}


def build(db_url: str, mq_url: str) -> Service:
    service = Service("billing", db_url=db_url, mq_url=mq_url, **SETTINGS)

    @service.on_command("job.run")
    async def run(message: Message, session: AsyncSession) -> None:
        await session.execute(
            text("INSERT INTO effects (message_id, type) VALUES (:m, 'job')"),
            {"m": str(message.message_id)},
        )
        if message.payload.get("poison"):
            os.kill(os.getpid(), signal.SIGKILL)  # after its effect, before any commit

    return service


def main() -> None:
    if sys.platform.startswith("linux"):  # die with the test that started this process
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    db_url, mq_url = sys.argv[1:3]
    service = build(db_url, mq_url)
    asyncio.run(service.run_async(relay=False, receiver=False, workers=1))


if __name__ == "__main__":
    main()
