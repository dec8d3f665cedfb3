"""Measuring: wall time and the CPU cores busy meanwhile, figures, and the bench's threads."""

from __future__ import annotations

import cProfile
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("bench")

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A phase could not finish."""


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of this machine spent busy since boot (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def tree_cpu_seconds(roots: frozenset[int]) -> float | None:
    """CPU seconds used by these processes, their descendants and their reaped children.

    By process tree, not process group: PostgreSQL backends each call setsid().
    """
    if not roots:
        return None
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, clock ticks)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()  # from field 3 (state) on
        if len(fields) > 14:
            # ppid; utime stime cutime cstime
            stats[int(entry.name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / CLOCK_TICKS


class Timer:
    """Wall time, and CPU cores busy meanwhile: the bench's processes (all threads), the servers
    it started, and everything else on the machine."""

    server_pids: frozenset[int] = frozenset()

    def __init__(self, extra_pids: frozenset[int] = frozenset()) -> None:
        self.extra_pids = extra_pids  # processes of the bench besides this one (trees)
        self.seconds = 0.0
        self.client_cores: float | None = None
        self.server_cores: float | None = None
        self.other_cores: float | None = None
        self._t0 = self._cpu0 = 0.0
        self._busy0: float | None = None
        self._servers0: float | None = None

    def start(self) -> None:
        self._busy0 = machine_busy_seconds()
        self._servers0 = tree_cpu_seconds(self.server_pids)
        self._cpu0 = time.process_time() + (tree_cpu_seconds(self.extra_pids) or 0.0)
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self.seconds <= 0:
            return
        cpu1 = time.process_time() + (tree_cpu_seconds(self.extra_pids) or 0.0)
        self.client_cores = (cpu1 - self._cpu0) / self.seconds
        busy1 = machine_busy_seconds()
        servers1 = tree_cpu_seconds(self.server_pids)
        if self._servers0 is not None and servers1 is not None:
            self.server_cores = (servers1 - self._servers0) / self.seconds
        if self._busy0 is not None and busy1 is not None:
            machine = (busy1 - self._busy0) / self.seconds
            self.other_cores = max(0.0, machine - self.client_cores - (self.server_cores or 0))

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class Figure:
    """One measured rate, and what it is compared with."""

    key: str
    title: str
    group: str  # "raw", "peer" or "library"
    unit: str = "msg/s"
    count: int = 0
    seconds: float = 0.0
    client_cores: float | None = None
    server_cores: float | None = None
    other_cores: float | None = None
    limit_of: tuple[str, ...] = ()  # the raw figure(s) this one is compared with (min of them)
    limit: float | None = None
    note: str = ""
    samples: list[float] = dataclasses.field(default_factory=list)  # rates of repeated attempts

    @property
    def rate(self) -> float | None:
        return self.count / self.seconds if self.count and self.seconds > 0 else None

    @property
    def cpu_us(self) -> float | None:
        """CPU microseconds the bench's processes spent per message (robust to a busy machine)."""
        if not self.count or self.client_cores is None:
            return None
        return self.client_cores * self.seconds / self.count * 1e6

    @property
    def ratio(self) -> float | None:
        rate = self.rate
        return rate / self.limit if rate is not None and self.limit else None

    def took(self, count: int, timer: Timer) -> Figure:
        self.count = count
        self.seconds = timer.seconds
        self.client_cores = timer.client_cores
        self.server_cores = timer.server_cores
        self.other_cores = timer.other_cores
        return self

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["limit_of"] = list(self.limit_of)
        data["rate"] = self.rate
        data["ratio"] = self.ratio
        data["cpu_us_per_message"] = self.cpu_us
        return data


class Threads:
    """Background threads running ``target(stop_event)``; optionally each under cProfile."""

    def __init__(self) -> None:
        self._running: list[tuple[threading.Thread, threading.Event]] = []
        self.errors: list[str] = []
        self.profile = False
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def start(self, name: str, target: Callable[[threading.Event], object]) -> None:
        stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(name, target, stop), name=f"bench-{name}", daemon=True
        )
        self._running.append((thread, stop))
        thread.start()

    def _run(
        self, name: str, target: Callable[[threading.Event], object], stop: threading.Event
    ) -> None:
        try:
            if self.profile:
                profiler = cProfile.Profile()
                try:
                    profiler.runcall(target, stop)
                finally:
                    with self._lock:
                        self._profiles.append(profiler)
            else:
                target(stop)
        except BaseException as exc:
            log.exception("thread %s failed", name)
            self.errors.append(f"{name}: {exc!r}")

    def stop_all(self, timeout: float = 30.0) -> None:
        for _thread, stop in self._running:
            stop.set()
        deadline = time.monotonic() + timeout
        for thread, _stop in self._running:
            thread.join(max(0.1, deadline - time.monotonic()))
        alive = [t.name for t, _ in self._running if t.is_alive()]
        self._running = []
        if alive:
            log.warning("threads still running after %.0f s: %s", timeout, alive)

    def take_profiles(self) -> list[cProfile.Profile]:
        with self._lock:
            profiles, self._profiles = self._profiles, []
        return profiles


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, threads: Threads) -> None:
    """Poll `predicate` every 10 ms; raise BenchError on timeout or when a bench thread failed."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if threads.errors:
            raise BenchError(f"{what}: {threads.errors[0]}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not finished after {timeout:.0f} s")
        time.sleep(0.01)


def fmt(value: float | None) -> str:
    """A rate with thousands separators, or '-'."""
    return f"{value:,.0f}" if value is not None else "-"
