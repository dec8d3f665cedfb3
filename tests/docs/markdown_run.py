"""Run a Markdown page's code blocks in order, as a reader would, and compare what they print.

The page marks its blocks with an HTML comment on the line(s) before the fence:

- ```` ```bash ```` — each line is a shell command, run in the working directory; it must exit 0.
- ```` ```console ```` — ``$ command`` lines, each followed by the output it prints on stdout;
  the command must exit 0 and its output must match (see :func:`normalize` and
  :func:`matches`).
- ``<!-- file: PATH -->`` before a block: the block is written to ``PATH`` in the directory.
- ``<!-- background -->`` before a ``bash`` block: each line is started as a long-running
  process (a reader's second terminal), stopped with SIGTERM at the end.
- ``<!-- eventually -->`` before a ``console`` block: run again until the outputs match, up to
  a timeout (the page says "within a moment").
- ``<!-- environment -->`` before a ``bash`` block of ``export NAME=value`` lines: the reader
  puts their servers there; the runner checks the names and gives its own values.
- ``<!-- not run: REASON -->``: skipped, with the reason written on the page.

A ``python``, ``bash``, ``sh`` or ``console`` block with none of these is an error: nothing on
the page escapes the run by accident. Blocks of other languages (or none) are not code to run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->\s*$")
RUNNABLE = {"python", "bash", "sh", "console"}


@dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence
    markers: list[str] = field(default_factory=list)

    def marker(self, name: str) -> str | None:
        """The value of marker `name` (``""`` for a bare marker), or None when absent."""
        for marker in self.markers:
            key, _, value = marker.partition(":")
            if key.strip() == name:
                return value.strip()
        return None


def parse_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the markers written just before each."""
    blocks: list[Block] = []
    markers: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        marker = _MARKER.match(line)
        if marker:
            markers.append(marker.group(1))
        elif fence:
            end = i + 1
            while end < len(lines) and lines[end].rstrip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"line {i + 1}: unclosed code block")
            body = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(fence.group(1), body, i + 1, markers))
            markers = []
            i = end
        elif line.strip():
            markers = []  # a marker applies to the block right after it
        i += 1
    return blocks


@dataclass
class Command:
    command: str
    expected: str


def console_commands(block: Block) -> list[Command]:
    """The ``$ command`` lines of a console block, each with the output written after it."""
    commands: list[Command] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append(Command(line[2:], ""))
        elif not commands:
            raise ValueError(f"line {block.line}: console block must start with '$ '")
        else:
            commands[-1].expected += line + "\n"
    return commands


_NORMALIZERS = [
    (re.compile(r"\b\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?"), "<time>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uuid>"),
    (re.compile(r"\bamqps?://\S+"), "<amqp-url>"),
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:ms|s|m|h|d)\b"), "<age>"),
    (re.compile(r"[ \t]+"), " "),
]


def normalize(output: str) -> str:
    """What of an output must match: times, message ids, broker URLs and ages replaced by
    placeholders (they differ between runs and machines), runs of blanks as one space (column
    widths follow the values), no trailing blanks, no blank lines at either end."""
    lines = []
    for line in output.splitlines():
        for pattern, replacement in _NORMALIZERS:
            line = pattern.sub(replacement, line)
        lines.append(line.strip())
    return "\n".join(lines).strip("\n")


def matches(expected: str, actual: str) -> bool:
    """True when the normalized `actual` matches the normalized `expected`, where a line
    ``...`` stands for any number of lines and ``...`` within a line for any text."""
    pattern = []
    for line in normalize(expected).split("\n"):
        if line == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(r"[^\n]*?".join(re.escape(part) for part in line.split("...")) + r"\n")
    return re.fullmatch("".join(pattern), normalize(actual) + "\n") is not None


class CommandFailed(AssertionError):
    pass


@dataclass
class PageRun:
    """Runs one page's blocks in `workdir` with `env`; call :meth:`stop` at the end."""

    page: Path
    workdir: Path
    env: dict[str, str]
    environment_names: set[str]
    timeout: float = 60.0
    eventually_timeout: float = 30.0
    background: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.started:6.1f}s {what}")

    def run_all(self) -> None:
        blocks = parse_blocks(self.page.read_text(encoding="utf-8"))
        for block in blocks:
            self.run_block(block)

    def where(self, block: Block) -> str:
        return f"{self.page.name} line {block.line}"

    def run_block(self, block: Block) -> None:
        if block.marker("not run") is not None:
            if not block.marker("not run"):
                raise AssertionError(f"{self.where(block)}: <!-- not run: --> needs a reason")
            self.note(f"skipped {self.where(block)}: {block.marker('not run')}")
            return
        path = block.marker("file")
        if path is not None:
            target = self.workdir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            self.note(f"wrote {path}")
            return
        if block.lang not in RUNNABLE:
            return
        if block.marker("environment") is not None:
            self.check_environment(block)
        elif block.lang == "python":
            raise AssertionError(
                f"{self.where(block)}: a python block needs <!-- file: PATH --> or "
                "<!-- not run: REASON -->"
            )
        elif block.marker("background") is not None:
            for line in _command_lines(block):
                self.start_background(line)
        elif block.lang == "console":
            self.run_console(block)
        else:
            for line in _command_lines(block):
                self.run(line, block)

    def check_environment(self, block: Block) -> None:
        names: set[str] = set()
        for line in _command_lines(block):
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[0] != "export":
                raise AssertionError(f"{self.where(block)}: environment block runs {line!r}")
            names.update(word.partition("=")[0] for word in words[1:])
        if names != self.environment_names:
            raise AssertionError(
                f"{self.where(block)}: the page sets {sorted(names)}, the test gives "
                f"{sorted(self.environment_names)}"
            )

    def run(self, command: str, block: Block) -> str:
        self.note(f"$ {command}")
        result = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        if result.returncode != 0:
            raise CommandFailed(
                f"{self.where(block)}: `{command}` exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result.stdout

    def run_console(self, block: Block) -> None:
        commands = console_commands(block)
        deadline = time.monotonic() + self.eventually_timeout
        while True:
            mismatch = None
            for command in commands:
                actual = self.run(command.command, block)
                if not matches(command.expected, actual):
                    mismatch = (
                        f"{self.where(block)}: `{command.command}` printed\n{actual}\n"
                        f"the page shows\n{command.expected}"
                    )
                    break
            if mismatch is None:
                return
            if block.marker("eventually") is None or time.monotonic() > deadline:
                raise AssertionError(mismatch)
            time.sleep(0.5)

    def start_background(self, command: str) -> None:
        log_path = self.workdir.parent / f"background-{len(self.background)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                ["bash", "-c", f"exec {command}"],  # exec: the signal reaches the command
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.note(f"started {command}")
        self.background.append((command, process, log_path))

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every background command; its exit status, None if it had to be killed."""
        for _, process, _ in self.background:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for command, process, _ in self.background:
            try:
                codes[command] = process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                codes[command] = None
        return codes

    def background_logs(self) -> str:
        return "\n".join(
            f"--- {command}\n{path.read_text(errors='replace')}"
            for command, _, path in self.background
        )


def _command_lines(block: Block) -> list[str]:
    return [line for line in block.text.splitlines() if line.strip()]


def base_env(bin_dir: Path) -> dict[str, str]:
    """The test process's environment without the variables a page sets, with `bin_dir` (the
    virtual environment's) first on PATH, as after ``. .venv/bin/activate``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PG", "OUTBOX_INBOX_"))
    }
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env
