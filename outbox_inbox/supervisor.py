"""Worker processes: a service's workers in several OS processes, supervised by the one that
runs the service (docs/runbook.md, "Worker processes").

Children are forked, not spawned: they need the service object with its handlers, which a
new interpreter could only rebuild from an import path. The parent forks before it starts
any thread of its own, and each child drops the parent's pooled database connections without
closing them (psycopg never closes a connection of another process). The hooks of a
listener marked `Listener.forwarded_from_workers` are forwarded to the parent."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from .listener import Listener

log = logging.getLogger(__name__)

#: The signals that stop a worker process gracefully.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
#: The longest pause before a child that keeps dying is started again.
MAX_RESTART_DELAY = 30.0
#: A child that lived this long before it died was not crash-looping: its restart waits 0 s.
STABLE_AFTER = 10.0


def available_cpus() -> int:
    """The CPUs this process may use: its CPU affinity, bounded by a cgroup CPU quota (a
    container's CPU limit, e.g. a Kubernetes ``limits.cpu``) rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota() -> float | None:
    """CPUs allowed by the cgroup's quota, or None without one (cgroup v2, then v1)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


#: What a child process runs (`Service` passes its own): given the child's stop event and the
#: listener that forwards hooks to the parent (None when nothing is forwarded), it runs the
#: workers until the event is set or one of them ends, and returns the process's exit code.
ChildMain = Callable[[threading.Event, Listener | None], int]


class WorkerProcesses:
    """`count` child processes of service `name`, each running `child`, kept running;
    `forwarded`: the parent's listeners that receive the hooks the children forward. Not
    thread-safe: use from the thread that runs the service (the main thread, for signals).
    `start()` forks them, `watch(stop)` restarts any that dies (after 1, 2, ...
    `MAX_RESTART_DELAY` s while they keep dying within `STABLE_AFTER` s), `stop()` ends them
    (SIGTERM, then a kill after `stop_timeout`)."""

    def __init__(
        self,
        name: str,
        count: int,
        child: ChildMain,
        forwarded: Sequence[Listener] = (),
        *,
        stop_timeout: float = 30.0,
    ) -> None:
        self._name, self._child, self._count = name, child, count
        self._stop_timeout = stop_timeout
        self._context = multiprocessing.get_context("fork")
        self._children: dict[int, tuple[BaseProcess, float]] = {}  # slot -> (process, started)
        self._metrics = list(forwarded)
        self._readers: list[threading.Thread] = []
        self._failures = 0

    @property
    def pids(self) -> list[int]:
        """The process ids of the children running now."""
        return [p.pid for p, _ in self._children.values() if p.pid is not None and p.is_alive()]

    def start(self) -> None:
        """Fork the children (returns at once; each waits for the database itself)."""
        for slot in range(self._count):
            self._start(slot)
        log.info(
            "service %s: %d worker processes started (pids %s)",
            self._name,
            self._count,
            ", ".join(str(p) for p in self.pids),
        )

    def _start(self, slot: int) -> None:
        receive, send = self._context.Pipe(duplex=False) if self._metrics else (None, None)
        process = self._context.Process(
            target=_child_main,
            args=(self._child, self._name, slot, send),
            name=f"outbox-inbox-{self._name}-worker-{slot}",
        )
        # The child inherits this thread's signal mask: a SIGTERM that reaches it before it
        # has its own handlers waits for them instead of going to the parent's copy.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if send is not None and receive is not None:
            send.close()  # the child's end: EOF here once the child is gone
            reader = threading.Thread(
                target=_apply_metrics,
                args=(receive, self._metrics),
                name=f"outbox-inbox-metrics-{slot}",
                daemon=True,
            )
            reader.start()
            self._readers.append(reader)
        self._children[slot] = (process, time.monotonic())

    def watch(self, stop: threading.Event) -> None:
        """Until `stop` is set: start again every child that ends, logging how it ended."""
        while not stop.is_set():
            sentinels = {p.sentinel: slot for slot, (p, _) in self._children.items()}
            ended = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            for sentinel in ended:
                slot = sentinels[sentinel]  # type: ignore[index]
                process, started = self._children[slot]
                # The sentinel fires when the child's files close, a moment before the kernel
                # makes it reapable: join(0) there saw no exit code and left a zombie.
                process.join(5)
                lived = time.monotonic() - started
                self._failures = 0 if lived >= STABLE_AFTER else self._failures + 1
                delay = min(MAX_RESTART_DELAY, 2 ** (self._failures - 1)) if self._failures else 0.0
                if stop.is_set():
                    return
                log.error(
                    "service %s: worker process %d (pid %s) %s after %.1f s; starting it again%s",
                    self._name,
                    slot,
                    process.pid,
                    _how_it_ended(process.exitcode),
                    lived,
                    f" in {delay:.0f} s" if delay else "",
                )
                if delay and stop.wait(delay):
                    return
                self._start(slot)

    def stop(self) -> None:
        """SIGTERM every child, wait up to ``stop_timeout`` seconds for all, kill the rest."""
        for process, _ in self._children.values():
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout
        for slot, (process, _) in self._children.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning(
                    "service %s: worker process %d (pid %s) still running after %.0f s: killed",
                    self._name,
                    slot,
                    process.pid,
                    self._stop_timeout,
                )
                process.kill()
                process.join(5)
        for reader in self._readers:
            reader.join(5)
        self._children = {}
        self._readers = []


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "ended"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _child_main(child: ChildMain, name: str, slot: int, metrics_pipe: Any) -> None:
    """A worker process: run `child` until SIGTERM, SIGINT or the parent's end; exit 0 after
    a graceful stop, 1 when a worker role ended by itself or `child` raised (restarted)."""
    stop = threading.Event()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the fork
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=_stop_with_parent, args=(parent.sentinel, stop), daemon=True
        ).start()
    forwarder = _MetricsForwarder(metrics_pipe) if metrics_pipe is not None else None
    code = 1
    try:
        code = child(stop, forwarder)
    except Exception:
        log.exception("service %s: worker process %d failed", name, slot)
    finally:
        if forwarder is not None:
            forwarder.close()
        logging.shutdown()
    os._exit(code)


def _stop_with_parent(sentinel: int, stop: threading.Event) -> None:
    multiprocessing.connection.wait([sentinel])
    if not stop.is_set():
        log.warning("worker process %d: its parent is gone; stopping", os.getpid())
        stop.set()


class _MetricsForwarder(Listener):
    """In a worker process: what the worker tells its metrics, sent to the parent's (JSON
    lines, flushed every 0.2 s by a thread of its own, so the hot path only appends)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()
        self._events: list[list[Any]] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, daemon=True)
        self._thread.start()

    def _add(self, event: list[Any]) -> None:
        with self._lock:
            self._events.append(event)

    def handled(self, message: Any) -> None:
        received = message.received_at.timestamp() if message.received_at is not None else None
        self._add(["handled", received])

    def failed(self, message: Any, error: BaseException, *, dead: bool) -> None:
        self._add(["failed", dead])

    def handler_ran(self, message: Any, seconds: float, error: BaseException | None) -> None:
        self._add(["handler_ran", seconds])

    def dead(self, reason: str, count: int) -> None:
        self._add(["dead", reason, count])

    def _flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        if events:
            with contextlib.suppress(OSError):
                self._pipe.send_bytes(json.dumps(events).encode())

    def _flush_loop(self) -> None:
        while not self._closed.wait(0.2):
            self._flush()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self._flush()
        with contextlib.suppress(OSError):
            self._pipe.close()


def _apply_metrics(pipe: Any, metrics: list[Any]) -> None:
    """In the parent: apply what a child's `_MetricsForwarder` sends, until the child is gone."""
    while True:
        try:
            events = json.loads(pipe.recv_bytes())
        except (EOFError, OSError):
            return
        except ValueError:
            log.warning("worker process metrics: unreadable data dropped")
            continue
        for name, *args in events:
            for each in metrics:
                with contextlib.suppress(Exception):
                    getattr(each, f"forwarded_{name}")(*args)
