"""Build the API reference of outbox_inbox's public modules from their docstrings (pdoc).

    python scripts/api_reference.py [OUTPUT_DIR]    (default: build/api)

Every warning is an error; tests/unit/test_api_reference.py runs this in CI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: The public modules: what a service, an operator's script or a test imports.
PUBLIC = [
    "outbox_inbox",
    "outbox_inbox.service",
    "outbox_inbox.aio",
    "outbox_inbox.config",
    "outbox_inbox.errors",
    "outbox_inbox.messages",
    "outbox_inbox.retry",
    "outbox_inbox.listener",
    "outbox_inbox.broker",
    "outbox_inbox.brokers.memory",
    "outbox_inbox.brokers.rabbitmq",
    "outbox_inbox.dead_letters",
    "outbox_inbox.audit_trail",
    "outbox_inbox.migrate",
    "outbox_inbox.status",
    "outbox_inbox.archive",
    "outbox_inbox.testing",
    "outbox_inbox.testing.broker_contract",
    "outbox_inbox.testing.servers",
]


def build(out: Path) -> subprocess.CompletedProcess[str]:
    """Run pdoc on PUBLIC into `out` with warnings as errors (from `out`'s parent directory,
    so that nothing in the current directory shadows a module)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "pdoc", *PUBLIC, "-o", str(out.resolve())],
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "build/api")
    result = build(target)
    sys.stderr.write(result.stderr)
    if result.returncode == 0:
        print(f"API reference in {target}/index.html")
    sys.exit(result.returncode)
