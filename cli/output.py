"""What the command prints: masked text, aligned tables, JSON, ages and progress bars.

Everything printed or logged goes through `mask`: URL passwords become ``***``, and so does any
password of a URL the command was given, wherever it appears.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import click

from outbox_inbox.logsafe import mask_text, remember

#: Exit codes (docs/cli.md).
EXIT_OK = 0
EXIT_ERROR = 1  # bad input, unreachable server, missing tables: one line on stderr
EXIT_USAGE = 2  # click's usage errors
EXIT_UNVERIFIED = 3  # topology verify: bindings could not be checked (no management API)
EXIT_UNHEALTHY = 4  # verify found drift; status over a threshold; replay left messages behind

#: Above this many items, replay and purge show a progress bar on stderr.
PROGRESS_THRESHOLD = 50


#: Mask the password of a URL in everything printed from now on; what may be printed.
remember_secret, mask = remember, mask_text


def echo(text: str = "", *, err: bool = False) -> None:
    click.echo(mask(text), err=err)


def echo_json(value: Any) -> None:
    click.echo(mask(json.dumps(value, indent=2, default=str, ensure_ascii=False)))


def plural(count: int, word: str, words: str | None = None) -> str:
    """``1 dead letter``, ``2 dead letters``: `count` and the word in the right number."""
    return f"{count} {word if count == 1 else words or word + 's'}"


def one_line(text: str | None, width: int = 60) -> str:
    """`text` on one line, cut to `width` characters."""
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: columns padded to their widest cell, two spaces apart."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        line = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        lines.append(line.rstrip())
    return "\n".join(lines)


@contextlib.contextmanager
def progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for more than PROGRESS_THRESHOLD items; yields `advance(n)`."""
    if total <= PROGRESS_THRESHOLD:
        yield lambda _n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


class MaskingFormatter(logging.Formatter):
    """A log formatter that masks passwords, like everything else the command prints, and
    names the worker process a line comes from (``[outbox-inbox-billing-worker-1 pid 42]``)."""

    def format(self, record: logging.LogRecord) -> str:
        forked = record.processName != "MainProcess"
        record.child = f" [{record.processName} pid {record.process}]" if forked else ""
        return mask(super().format(record))


#: Where a command keeps its -v count (`click.Context.meta` is shared by nested contexts).
VERBOSE = "outbox_inbox.verbose"


def configure_logging(verbose: int) -> None:
    """Log to stderr, masked: WARNING and up, INFO with -v, DEBUG with -vv."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        MaskingFormatter("%(asctime)s %(levelname)s%(child)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING - 10 * min(verbose, 2))
    # pika logs every failed connection attempt at ERROR; the command reports it in one line.
    logging.getLogger("pika").setLevel(logging.DEBUG if verbose >= 2 else logging.CRITICAL)


def verbosity(ctx: click.Context | None = None) -> int:
    """How many -v the command was given, before or after its name (0 outside a command)."""
    ctx = ctx or click.get_current_context(silent=True)
    return int(ctx.meta.get(VERBOSE, 0)) if ctx is not None else 0


def more_verbose(ctx: click.Context, _param: click.Parameter, count: int) -> None:
    """Callback of the -v a subcommand takes: adds to the count and logs accordingly."""
    if count:
        ctx.meta[VERBOSE] = verbosity(ctx) + count
        configure_logging(ctx.meta[VERBOSE])
