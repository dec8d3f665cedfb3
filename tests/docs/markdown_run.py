"""Run a Markdown page's code blocks in order, as a reader would, and compare what they print.

The page marks its blocks with an HTML comment on the line(s) before the fence:

- ```` ```bash ```` — a shell script, run in the working directory as the reader pastes it
  into one shell (``bash -euo pipefail``: an unset variable or a failing command stops it); it
  must exit 0.
- ```` ```console ```` — ``$ command`` lines, each followed by the output it prints on stdout;
  the command must exit 0 and its output must match (see :func:`normalize` and
  :func:`matches`).
- ``<!-- file: PATH -->`` before a block: the block is written to ``PATH`` in the directory.
- ``<!-- background -->`` before a ``bash`` block: each command (a trailing ``\\`` continues
  it) is started as a long-running process (a reader's second terminal), stopped with SIGTERM
  at the end.
- ``<!-- eventually -->`` before a ``console`` block: run again until the commands succeed and
  their outputs match, up to a timeout (the page says "within a moment").
- ``<!-- environment -->`` before a ``bash`` block of ``export NAME=value`` lines: the reader
  puts their servers there; the runner checks the names and gives its own values.
- ``<!-- run by: PATH -->``: another test, the file PATH of the repository, runs the block
  (with names of its own, or while talking to what it starts); that file names the page.
- ``<!-- fragment -->``: a deliberate excerpt that is no complete program (a handler's
  signature, a line of your own alembic ``env.py``, an installation command): not run, but it
  must parse (``ast`` for Python, ``bash -n`` for shell), and its first line is a comment
  ``# fragment: ...`` so that the reader sees it too.

A ``python`` block with no marker is run: the Python blocks that follow one another, with no
shell block between them, are one program run in the working directory (one interpreter, one
namespace), which must exit 0. A ``python``, ``bash``, ``sh`` or ``console`` block is always run,
written, checked or a fragment: nothing on the page escapes the run by accident (there is no
"not run"). Blocks of other languages (or none) are not code to run.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
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
    #: A bound on a block that hangs, not a speed check: an audit's first Spark start on a busy
    #: two-core machine takes a minute.
    timeout: float = 180.0
    eventually_timeout: float = 30.0
    background: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    #: How each code block was taken: run, written, environment, elsewhere or fragment.
    counts: Counter[str] = field(default_factory=Counter)
    _program: list[Block] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.started:6.1f}s {what}")

    def run_all(self) -> None:
        blocks = parse_blocks(self.page.read_text(encoding="utf-8"))
        for block in blocks:
            self.run_block(block)
        self.run_program()

    def where(self, block: Block) -> str:
        return f"{self.page.name} line {block.line}"

    def run_block(self, block: Block) -> None:
        if block.marker("not run") is not None:
            raise AssertionError(
                f"{self.where(block)}: <!-- not run --> is gone: run the block, or mark a "
                "deliberate excerpt <!-- fragment -->"
            )
        if block.lang not in RUNNABLE and block.marker("file") is None:
            return
        if block.marker("fragment") is not None:
            check_fragment(block, self.where(block))
            self.counts["fragment"] += 1
            self.note(f"fragment {self.where(block)}")
            return
        runner = block.marker("run by")
        if runner is not None:
            check_runner(runner, self.page, self.where(block))
            self.counts["elsewhere"] += 1
            self.note(f"{self.where(block)} is run by {runner}")
            return
        path = block.marker("file")
        if path is not None:
            target = self.workdir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            self.counts["written"] += 1
            self.note(f"wrote {path}")
            return
        if block.lang == "python":
            self._program.append(block)
            self.counts["run"] += 1
            return
        self.run_program()
        if block.marker("environment") is not None:
            self.check_environment(block)
            self.counts["environment"] += 1
            return
        self.counts["run"] += 1
        if block.marker("background") is not None:
            for line in _command_lines(block):
                self.start_background(line)
        elif block.lang == "console":
            self.run_console(block)
        else:
            self.run(block.text, block, "-euo")

    def run_program(self) -> None:
        """Run the Python blocks read since the last shell block as one program."""
        blocks, self._program = self._program, []
        if not blocks:
            return
        program = "".join(f"# {self.where(b)}\n{b.text}" for b in blocks)
        self.note(f"python {', '.join(self.where(b) for b in blocks)}")
        result = subprocess.run(
            [sys.executable, "-c", program],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=self.timeout * 2,
        )
        if result.returncode != 0:
            raise CommandFailed(
                f"{self.where(blocks[0])}: its Python ({len(blocks)} block(s)) exited "
                f"{result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
                f"stderr:\n{result.stderr[-3000:]}"
            )

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

    def run(self, command: str, block: Block, options: str = "-o") -> str:
        """Run `command` with ``bash OPTIONS pipefail``; its stdout. Raises CommandFailed."""
        self.note(f"$ {command.strip()}")
        result = subprocess.run(
            ["bash", options, "pipefail", "-c", command],
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
                try:
                    actual = self.run(command.command, block)
                except CommandFailed as failed:
                    if block.marker("eventually") is None or time.monotonic() > deadline:
                        raise
                    mismatch = str(failed)
                    break
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


REPOSITORY = Path(__file__).resolve().parents[2]


def check_runner(runner: str, page: Path, where: str) -> None:
    """The test file `runner` exists and names `page`."""
    path = REPOSITORY / runner
    if not path.is_file() or page.name not in path.read_text(encoding="utf-8"):
        raise AssertionError(f"{where}: <!-- run by: {runner} -->: no such test naming {page.name}")


def check_fragment(block: Block, where: str) -> None:
    """A fragment parses, and says on its first line that it is one."""
    if not block.text.startswith("# fragment: "):
        raise AssertionError(f"{where}: a fragment's first line is '# fragment: what it is'")
    if block.lang == "python":
        try:
            ast.parse(block.text)
        except SyntaxError as exc:
            raise AssertionError(f"{where}: not valid Python: {exc}") from None
        return
    if block.lang == "console":
        raise AssertionError(f"{where}: a console block shows what runs; not a fragment")
    checked = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    if checked.returncode != 0:
        raise AssertionError(f"{where}: not valid shell: {checked.stderr}")


def _command_lines(block: Block) -> list[str]:
    """The block's commands: a line ending in a backslash continues on the next; blank and
    comment lines are none."""
    commands: list[str] = []
    pending = ""
    for line in block.text.splitlines():
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        command, pending = pending + line, ""
        if command.strip() and not command.lstrip().startswith("#"):
            commands.append(command)
    return commands


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
    env["OUTBOX_INBOX_SPARK_SERVER"] = "none"  # no warm Spark server outlives the page's run
    env["OUTBOX_INBOX_SPARK_DIR"] = str(Path(tempfile.gettempdir()) / "outbox-inbox-test-spark")
    return env
