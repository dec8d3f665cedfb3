"""The `--audit-log` option, and the audit line written with the CLI's masking.

The audit trail itself is the library's (outbox_inbox.audit_trail).
"""

from __future__ import annotations

from typing import Any

import click

from outbox_inbox.audit_trail import AUDIT_LOG_ENV, DEFAULT_AUDIT_LOG
from outbox_inbox.audit_trail import write_audit as _write_audit

from .output import mask

audit_log_option = click.option(
    "--audit-log",
    metavar="PATH",
    envvar=AUDIT_LOG_ENV,
    default=DEFAULT_AUDIT_LOG,
    show_default=True,
    help=f"File the audit line is appended to [env {AUDIT_LOG_ENV}].",
)


def write_audit(path: str, **fields: Any) -> dict[str, Any]:
    """outbox_inbox.audit_trail.write_audit, masking every password the CLI was given."""
    return _write_audit(path, mask=mask, **fields)
