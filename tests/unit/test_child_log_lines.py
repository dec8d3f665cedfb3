"""The command's log lines name the forked worker process that wrote them."""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

from outbox_inbox.cli.output import configure_logging


def _log_a_line() -> None:
    logging.getLogger("outbox_inbox.worker").error("from the child")


def test_a_forked_workers_log_lines_name_its_process_and_the_parents_do_not(
    tmp_path: Path,
) -> None:
    root = logging.getLogger()
    kept = (root.handlers[:], root.level)
    configure_logging(0)
    [handler] = root.handlers
    assert isinstance(handler, logging.StreamHandler)
    out = (tmp_path / "log").open("w")
    handler.setStream(out)
    try:
        logging.getLogger("outbox_inbox.relay").error("from the parent")
        out.flush()
        child = multiprocessing.get_context("fork").Process(
            target=_log_a_line, name="outbox-inbox-billing-worker-1"
        )
        child.start()
        child.join(10)
    finally:
        root.handlers[:], level = kept
        root.setLevel(level)
        out.close()
    parent, forked = (tmp_path / "log").read_text().splitlines()
    assert " ERROR outbox_inbox.relay: from the parent" in parent
    expected = f" ERROR [outbox-inbox-billing-worker-1 pid {child.pid}] outbox_inbox.worker:"
    assert expected in forked
