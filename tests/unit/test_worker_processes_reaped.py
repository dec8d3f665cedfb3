"""The supervisor of worker processes logs how a child ended and leaves no zombie, even when
the child's sentinel fires a while before the child can be reaped."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from helpers import wait_until
from outbox_inbox import Service, supervisor
from outbox_inbox.brokers.memory import MemoryBroker


def _closes_its_files_then_is_killed(child: Any, name: str, slot: int, pipe: Any) -> None:
    # Closing every file closes the sentinel's pipe: the parent sees the end 0.5 s before the
    # process exits, the window a SIGKILLed child's exit takes at worst.
    os.closerange(3, 65536)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_whose_sentinel_fires_early_is_reaped_and_its_signal_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(supervisor, "_child_main", _closes_its_files_then_is_killed)
    with MemoryBroker() as broker:
        service = Service("billing", db_url=f"sqlite:///{tmp_path / 'b.db'}", broker=broker)
        children = supervisor.WorkerProcesses(
            service.name, 1, service._worker_process, stop_timeout=1
        )
        stop = threading.Event()
        caplog.set_level(logging.ERROR, logger="outbox_inbox.supervisor")
        children.start()
        [first] = children.pids
        watcher = threading.Thread(target=children.watch, args=(stop,))
        watcher.start()
        try:
            [ended] = wait_until(
                lambda: [r.getMessage() for r in caplog.records if "worker process" in r.msg]
            )
        finally:
            stop.set()
            watcher.join(10)
            children.stop()
            service.close()
    assert f"(pid {first}) was killed by SIGKILL" in ended
    with pytest.raises(ChildProcessError):
        os.waitpid(first, os.WNOHANG)  # reaped already: no zombie left behind
