"""The audit trail of operator actions: one JSON line per replay or purge, in a file and the log.

Written by `DeadLetters.run` for every action — dry runs and empty selections included —
whoever asked: the CLI, the dashboard, or a service's own code.
"""

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
    """Append one line (who, on which host, what, how many) to `path`, log it at WARNING, and
    return it.

    `client` names who asked when it is not the user running the process (the dashboard:
    the authenticated user and the remote address). `mask` hides passwords in the line.
    The file is opened in append mode and written with one write call, so lines of concurrent
    operators do not interleave.
    """
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
    log.warning("audit: %s", line)
    return entry
