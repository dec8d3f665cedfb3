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


def test_a_service_without_handlers_forks_no_worker_processes_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher's worker only marks what it is sent ``no_handler``: by default it runs in
    the service's own process, not in one idle process per CPU; ``processes`` set still wins."""
    monkeypatch.setattr("outbox_inbox.service.available_cpus", lambda: 4)
    url = "postgresql+psycopg://app@127.0.0.1:1/orders"  # never connected to
    with MemoryBroker() as broker:
        publisher = Service("orders", db_url=url, broker=broker)
        assert publisher.worker_processes() == 1
        assert Service("orders", db_url=url, broker=broker, processes=3).worker_processes() == 3
        consumer = Service("billing", db_url=url, broker=broker)
        consumer.on_event("orders.order.placed")(lambda message, session: None)
        assert consumer.worker_processes() == 4
