"""A handler that ends "the program" (``sys.exit()``) is a handler failure, never a silent role
death: ``outbox-inbox run all`` logs it with the message and the handler, handles the other
messages of the batch, retries the message, and exits 0 on SIGTERM with every role alive."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import cli_app
import pytest

from helpers import rows, wait_until
from outbox_inbox import Service

INVOICE = "billing.invoice.create"
LEDGER = "billing.ledger.append"


def _set_exiting(service: Service, *types: str) -> None:
    cli_app.set_types(service, "exiting", *types)


def _effects(db_url: str) -> set[str]:
    return {r[0] for r in rows(db_url, "SELECT type FROM effects")}


@pytest.mark.parametrize("processes", [1, 2], ids=["worker-threads", "worker-processes"])
def test_a_handler_calling_sys_exit_is_a_named_failure_and_its_batch_mates_are_handled(
    spawn: Callable[..., Any],
    make_service: Callable[..., Service],
    db_url: str,
    processes: int,
) -> None:
    service = make_service()
    _set_exiting(service, INVOICE)
    runner = spawn("run", "all", "--app", "cli_app:billing", "--processes", str(processes))
    with service.session() as session, session.begin():
        doomed = service.outbox.send(session, "billing", "invoice.create", {"n": 1})
        service.outbox.send(session, "billing", "ledger.append", {"n": 2})

    # The innocent message of the same batch is handled; the exiting one is retried, its
    # error recorded on its row.
    wait_until(lambda: LEDGER in _effects(db_url), timeout=60, what="the innocent message")
    wait_until(
        lambda: rows(
            db_url,
            "SELECT 1 FROM outbox_inbox.inbox_messages"
            " WHERE message_id = :m AND status = 'pending' AND last_error LIKE '%SystemExit%'",
            m=str(doomed),
        ),
        timeout=30,
        what="the exiting message recorded as a failure, to retry",
    )
    # The worker lived on: once the handler stops exiting, its retry is handled.
    _set_exiting(service)
    wait_until(lambda: INVOICE in _effects(db_url), timeout=60, what="the retried message")

    assert runner.poll() is None, "run all ended"
    runner.send_signal(signal.SIGTERM)
    out, err = runner.communicate(timeout=60)
    log = out + err
    assert runner.returncode == 0, log
    failure = [line for line in log.splitlines() if str(doomed) in line and "SystemExit" in line]
    assert failure, f"no line names the message and SystemExit:\n{log}"
    assert "_record" in failure[0], f"the handler is not named: {failure[0]}"
    assert "crashed" not in log and "Traceback" not in log, log
