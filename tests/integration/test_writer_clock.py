"""A writer's host clock never decides when a message expires or becomes due.

The writer runs in a process of its own under libfaketime, 10 minutes slow or fast; PostgreSQL
runs on the real clock. ``ttl=`` and ``delay=`` must mean the same as from a correct clock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from helpers import make_service, rows

ROOT = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import json, sys, time
    from outbox_inbox import Service

    service = Service("orders", db_url=sys.argv[1], mq_url=None)
    with service.session() as session, session.begin():
        expiring = service.outbox.publish(session, "order.placed", {"n": 1}, ttl=60)
        delayed = service.outbox.publish(session, "order.placed", {"n": 2}, delay=2)
        plain = service.outbox.publish(session, "order.placed", {"n": 3})
    print(json.dumps({"host_time": time.time(), "expiring": str(expiring),
                      "delayed": str(delayed), "plain": str(plain)}))
    service.close()
    """
)


@pytest.mark.parametrize("skew", ["-10m", "+10m"])
def test_ttl_and_delay_are_judged_on_the_database_clock_whatever_the_writers_clock(
    db_url: str, skew: str
) -> None:
    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.skip("faketime is not installed (scripts/test installs Debian's faketime)")
    make_service("orders", db_url, None)

    written = subprocess.run(
        [faketime, "-f", skew, sys.executable, "-c", WRITER, db_url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(written.stdout.strip().splitlines()[-1])
    # The writer's clock really was off by about 10 minutes.
    assert abs(abs(result["host_time"] - time.time()) - 600) < 30

    by_id = {
        str(r.message_id): r
        for r in rows(
            db_url,
            "SELECT message_id, created_at, available_at, expires_at "
            "FROM outbox_inbox.outbox_messages",
        )
    }
    expiring, delayed, plain = (by_id[result[k]] for k in ("expiring", "delayed", "plain"))
    assert expiring.expires_at - expiring.created_at == timedelta(seconds=60)
    assert expiring.available_at == expiring.created_at
    assert delayed.available_at - delayed.created_at == timedelta(seconds=2)
    assert delayed.expires_at is None
    assert (plain.available_at, plain.expires_at) == (plain.created_at, None)
