"""Runs Quint's simulator on configurations of spec/breaks.qnt and reads its reports.

Quint is installed into spec/node_modules by scripts/test (``npm ci``); its TypeScript
simulator is used because the default Rust one is a binary fetched at first use from outside
the package registries.

:class:`Background` runs a session's simulations in processes of the lowest priority (nice 19
and ``SCHED_IDLE``), so that they use only the CPU the other tests leave idle; a test collects
its report when it needs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

SPEC = Path(__file__).resolve().parents[2] / "spec"
QUINT = SPEC / "node_modules" / ".bin" / "quint"

INVARIANTS = (
    "ExactlyOnceEffect",
    "NoEffectWithoutCommit",
    "KeyOrderOfEffects",
    "DeadMessageHasNoEffectAndItsFault",
    "NothingClaimedByTwoLiveWorkers",
    "NothingDroppedInsideDuplicateWindow",
    "BoundedLiveness",
)

_OK = re.compile(r"^\[ok\] No violation found", re.M)
_VIOLATION = re.compile(r"^\[violation\]", re.M)
_BROKEN = re.compile(r"❌ (\w+)")
_WITNESS = re.compile(r"^(\w+) was witnessed in (\d+) trace\(s\) out of (\d+) explored", re.M)
_LENGTHS = re.compile(r"Trace length statistics: max=(\d+), min=(\d+)")
_SEED = re.compile(r"Use --seed=(0x[0-9a-f]+)")


@dataclass(frozen=True)
class Job:
    """One ``quint run``: ``samples`` runs of ``steps`` steps of module ``config`` from
    ``seed``, checking ``invariants`` (every named one by default) and counting ``witnesses``.
    Quint stops at the first violation."""

    config: str
    samples: int
    steps: int
    seed: int
    invariants: tuple[str, ...] = INVARIANTS
    witnesses: tuple[str, ...] = ()

    def command(self) -> list[str]:
        cmd = [
            str(QUINT), "run", "breaks.qnt", "--main", self.config, "--backend", "typescript",
            "--max-samples", str(self.samples), "--max-steps", str(self.steps),
            "--seed", hex(self.seed), "--verbosity", "2", "--invariants", *self.invariants,
        ]  # fmt: skip
        if self.witnesses:
            cmd += ["--witnesses", *self.witnesses]
        return cmd


@dataclass
class Report:
    """What one ``quint run`` said."""

    config: str
    ok: bool
    violated: set[str]
    witnessed: dict[str, int] = field(default_factory=dict)
    explored: int = 0
    min_length: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    steps: int = 0
    seed: str = ""  # of the violating run: ``--seed SEED --max-samples 1`` replays it
    output: str = ""

    def failure(self) -> str:
        """The violated invariants, the command replaying the violation and the report's end."""
        return (
            f"{self.config} violated {sorted(self.violated)}; replay the run with: cd spec &&"
            f" npx quint run breaks.qnt --main {self.config} --backend typescript --max-samples 1"
            f" --max-steps {self.steps} --seed {self.seed} --verbosity 3"
            f" --invariants {' '.join(sorted(self.violated))}\n{self.output[-4000:]}"
        )


def rare_premises(witnessed: dict[str, int], explored: int, names: Iterable[str]) -> dict[str, int]:
    """The witnesses of ``names`` true in fewer than 1 % of ``explored`` runs (a missing one
    counts 0): the invariants whose premise hardly came up, so their checks said little."""
    counts = {name: witnessed.get(name, 0) for name in names}
    return {name: count for name, count in counts.items() if count < 0.01 * explored}


def _read(job: Job, out: str, returncode: int, seconds: float, cpu: float) -> Report:
    ok = bool(_OK.search(out))
    if not ok and not _VIOLATION.search(out):
        raise RuntimeError(f"quint run {job.config} failed (exit {returncode}):\n{out[-3000:]}")
    violated = set(_BROKEN.findall(out))
    if not ok and not violated and len(job.invariants) == 1:
        violated = set(job.invariants)  # Quint lists the violated ones only when it checks several
    seed = _SEED.search(out)
    report = Report(
        job.config, ok, violated, seconds=seconds, cpu_seconds=cpu, output=out,
        steps=job.steps, seed=seed.group(1) if seed else "",
    )  # fmt: skip
    for name, count, explored in _WITNESS.findall(out):
        report.witnessed[name] = int(count)
        report.explored = int(explored)
    lengths = _LENGTHS.search(out)
    if lengths:
        report.min_length = int(lengths.group(2))
    return report


def _run(job: Job, report_file: IO[str], started: float, proc: subprocess.Popen[bytes]) -> Report:
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    report_file.seek(0)
    cpu = usage.ru_utime + usage.ru_stime
    return _read(job, report_file.read(), proc.returncode, time.monotonic() - started, cpu)


def _priority(pid: int, *, idle: bool) -> None:
    """The lowest CPU priority (nice 19, ``SCHED_IDLE``) for process ``pid``, or back to the
    normal one (nice 0, ``SCHED_OTHER``, as far as the process's rights allow)."""
    try:
        if idle:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, pid, 0)
    except ProcessLookupError:
        pass  # it ended already
    except PermissionError:
        pass  # not allowed to raise its nice value again: it stays at 19


class Background:
    """Runs ``jobs`` in their order at the lowest CPU priority, one at a time, until a test
    waits for a report; then ``slots`` at a time at the normal priority.

    Each simulation is a process of its own under ``nice 19`` and ``SCHED_IDLE``: a runnable
    task of any other priority takes the CPU from it, so it runs on CPU time no test wants. It
    still slows the tests a little (on the project's 2-CPU virtual machine, a test file that
    leaves most of the CPU idle ran 12 % longer beside one simulation, 30 % beside two), hence
    one at a time. The model checks run last: once a test waits, nothing else runs.

    A simulation is killed by :meth:`close` and, should the test process die first, by the kernel
    (``setpriv --pdeathsig KILL``)."""

    def __init__(self, jobs: Iterable[Job], slots: int) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._closed = False
        self._waited = False
        self._slots = slots
        self._gate = threading.Semaphore(1)  # one at a time until a test waits
        self._executor = ThreadPoolExecutor(slots, thread_name_prefix="quint")
        self._futures: dict[Job, Future[Report]] = {
            job: self._executor.submit(self._simulate, job) for job in dict.fromkeys(jobs)
        }

    def _simulate(self, job: Job) -> Report:
        # Into a file, not a pipe: Node writes to a pipe asynchronously and drops what is still
        # queued when Quint exits, so a long report through a pipe lost its last lines.
        with tempfile.TemporaryFile("w+") as report_file, self._gate:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the background simulations were stopped")
                started = time.monotonic()
                proc = subprocess.Popen(
                    ["setpriv", "--pdeathsig", "KILL", "--", *job.command()],
                    cwd=SPEC, stdout=report_file, stderr=subprocess.STDOUT,
                )  # fmt: skip
                self._procs.add(proc)
                if not self._waited:
                    _priority(proc.pid, idle=True)
            try:
                return _run(job, report_file, started, proc)
            finally:
                with self._lock:
                    self._procs.discard(proc)

    def report(self, job: Job, timeout: float) -> Report:
        """``job``'s report, waiting for it at most ``timeout`` seconds (then TimeoutError);
        a job the session did not start is started now."""
        with self._lock:
            if not self._waited:  # nothing else runs once a test waits: full speed from now
                self._waited = True
                for proc in self._procs:
                    _priority(proc.pid, idle=False)
                for _ in range(self._slots - 1):
                    self._gate.release()
            future = self._futures.get(job)
            if future is None:
                future = self._futures[job] = self._executor.submit(self._simulate, job)
        return future.result(timeout)

    def close(self) -> None:
        """Stops every simulation still queued or running."""
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for future in self._futures.values():
            future.cancel()
        for proc in procs:
            proc.kill()
        for _ in range(self._slots):
            self._gate.release()  # a job waiting for its turn sees that it was stopped
        self._executor.shutdown(wait=True, cancel_futures=True)
