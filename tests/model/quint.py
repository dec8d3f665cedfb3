"""Runs Quint's simulator on one configuration of spec/breaks.qnt and reads its report.

Quint is installed into spec/node_modules by scripts/test (``npm ci``); its TypeScript
simulator is used because the default Rust one is a binary fetched at first use from outside
the package registries.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    output: str = ""


def simulate(
    config: str,
    *,
    samples: int,
    steps: int,
    seed: int,
    invariants: tuple[str, ...] = INVARIANTS,
    witnesses: tuple[str, ...] = (),
    timeout: float = 280,
) -> Report:
    """Simulates ``samples`` runs of ``steps`` steps of module ``config``, checking
    ``invariants`` (every named one by default); stops at the first violation, as Quint does."""
    cmd = [
        str(QUINT), "run", "breaks.qnt", "--main", config, "--backend", "typescript",
        "--max-samples", str(samples), "--max-steps", str(steps), "--seed", hex(seed),
        "--verbosity", "2", "--invariants", *invariants,
    ]  # fmt: skip
    if witnesses:
        cmd += ["--witnesses", *witnesses]
    started = time.monotonic()
    # Into a file, not a pipe: Node writes to a pipe asynchronously and drops what is still
    # queued when Quint exits, so a long report through a pipe lost its last lines.
    with tempfile.TemporaryFile("w+") as report_file:
        done = subprocess.run(
            cmd, cwd=SPEC, stdout=report_file, stderr=subprocess.STDOUT, timeout=timeout,
            check=False,
        )  # fmt: skip
        report_file.seek(0)
        out = report_file.read()
    seconds = time.monotonic() - started
    ok = bool(_OK.search(out))
    if not ok and not _VIOLATION.search(out):
        raise RuntimeError(f"quint run {config} failed (exit {done.returncode}):\n{out[-3000:]}")
    violated = set(_BROKEN.findall(out))
    if not ok and not violated and len(invariants) == 1:
        violated = set(invariants)  # Quint lists the violated ones only when it checks several
    report = Report(config, ok, violated, seconds=seconds, output=out)
    for name, count, explored in _WITNESS.findall(out):
        report.witnessed[name] = int(count)
        report.explored = int(explored)
    lengths = _LENGTHS.search(out)
    if lengths:
        report.min_length = int(lengths.group(2))
    return report
