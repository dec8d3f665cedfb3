"""The audit trail of operator actions: one JSON line per replay or purge, in a file. Written by
`DeadLetters.run` for every action — dry runs and empty selections included — whoever asked: the
CLI, the dashboard, or a service's own code (`write_audit`)."""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .logsafe import mask_url

AUDIT_LOG_ENV = "OUTBOX_INBOX_AUDIT_LOG"
DEFAULT_AUDIT_LOG = "outbox-inbox-audit.log"
#: An audit line names at most this many message ids; `count` always has the full number.
MAX_IDS = 1000

log = logging.getLogger("outbox_inbox.audit")


def audit_log_path() -> str:
    """The audit trail's file when none is named: ``$OUTBOX_INBOX_AUDIT_LOG``, else
    ``outbox-inbox-audit.log`` in the current directory (the CLI's ``--audit-log`` default)."""
    return os.environ.get(AUDIT_LOG_ENV) or DEFAULT_AUDIT_LOG


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (containers)
        return f"uid:{os.getuid()}"


def write_audit(
    path: str | os.PathLike[str],
    *,
    command: str,
    service: str | None,
    source: str,
    filters: dict[str, Any],
    counts: dict[str, int],
    message_ids: list[str],
    dry_run: bool,
    error: str | None = None,
    client: str | None = None,
    mask: Callable[[str], str] = mask_url,
) -> dict[str, Any]:
    """Append one line (who, on which host, what, how many) to `path` and return it. Logs one short
    line on ``outbox_inbox.audit`` saying what was done, how many and where the record is: at
    WARNING for an action, at INFO for a dry run (which changes nothing); the whole record is the
    log record's ``audit`` attribute, for structured log handlers. `client` names who asked when it
    is not the user running the process (the dashboard: the authenticated user and the remote
    address). `mask` hides passwords in the line. The file is opened in append mode and written with
    one write call, so lines of concurrent operators do not interleave. Raises OSError when the file
    cannot be written."""
    entry: dict[str, Any] = {
        "time": datetime.now(UTC).isoformat(),
        "user": _user(),
        "host": socket.gethostname(),
        "command": command,
        "service": service,
        "source": source,
        "filters": filters,
        "count": sum(counts.values()),
        "counts": counts,
        "dry_run": dry_run,
        "message_ids": message_ids[:MAX_IDS],
    }
    if len(message_ids) > MAX_IDS:
        entry["message_ids_truncated"] = True
    if error is not None:
        entry["error"] = error
    if client is not None:
        entry["client"] = client
    line = mask(json.dumps(entry, ensure_ascii=False, default=str))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as file:
        file.write(line + "\n")
    level = logging.INFO if dry_run else logging.WARNING
    log.log(level, "%s", mask(_summary(entry, path)), extra={"audit": json.loads(line)})
    return entry


def _summary(entry: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """The record in one short line: ``audit: dead-letters replay: 2 dead letters of billing
    (table 2), by alice on ops-1; recorded in /srv/outbox-inbox-audit.log``."""
    count = entry["count"]
    what = f"{count} dead letter{'' if count == 1 else 's'}"
    if entry["service"]:
        what += f" of {entry['service']}"
    counts = ", ".join(f"{source} {n}" for source, n in entry["counts"].items())
    who = entry.get("client") or f"{entry['user']} on {entry['host']}"
    dry = " (dry run: nothing changed)" if entry["dry_run"] else ""
    failed = f", failed: {str(entry['error']).splitlines()[0][:160]}" if "error" in entry else ""
    return (
        f"audit: {entry['command']}{dry}: {what} ({counts or 'no source'}), by {who}{failed}; "
        f"recorded in {os.path.abspath(path)}"
    )


__all__ = ["audit_log_path"]
