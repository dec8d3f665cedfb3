"""What the dashboard tests share: the running command, HTTP requests to it, dead letters."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from helpers import inbox_message_ids, wait_until
from outbox_inbox import Service

INVOICE = "billing.invoice.create"
TOKEN = "dashboard-token-0123456789"


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: str
    cookies: dict[str, str] = field(default_factory=dict)


@dataclass
class RunningDashboard:
    """A running `outbox-inbox dashboard` process and its base URL."""

    process: subprocess.Popen[str]
    url: str
    audit_log: Path

    def request(
        self,
        path: str,
        *,
        data: Mapping[str, Any] | list[tuple[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """One HTTP request (a POST when `data` is given); never raises on a status code."""
        body = None
        if data is not None:
            items = data.items() if isinstance(data, Mapping) else data
            body = urllib.parse.urlencode(list(items)).encode()
        req = urllib.request.Request(
            self.url.rstrip("/") + path, data=body, headers=dict(headers or {})
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as reply:
                return _reply(reply.status, reply.headers, reply.read())
        except urllib.error.HTTPError as exc:
            return _reply(exc.code, exc.headers, exc.read())

    def audit(self) -> list[dict[str, Any]]:
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines()]


def _reply(status: int, headers: Any, raw: bytes) -> Reply:
    cookies = {}
    for value in headers.get_all("Set-Cookie") or []:
        name, _, rest = value.partition("=")
        cookies[name] = rest.split(";", 1)[0]
    return Reply(status, headers, raw.decode("utf-8"), cookies)


def csrf_of(page: str) -> str:
    match = re.search(r'name=csrf value="([0-9a-f]+)"', page)
    assert match, f"no CSRF token in the page:\n{page[:2000]}"
    return match[1]


def set_failing(service: Service, *types: str) -> None:
    """Make the handlers reject these types (dead letters), or none (the bug is fixed)."""
    with service.engine.begin() as conn:
        conn.execute(text("DELETE FROM failing"))
        for t in types:
            conn.execute(text("INSERT INTO failing (type) VALUES (:t)"), {"t": t})


def dead_ids(db_url: str) -> list[str]:
    return inbox_message_ids(db_url, "dead")


def wait_dead(db_url: str, count: int) -> list[str]:
    return wait_until(
        lambda: (ids := dead_ids(db_url)) and len(ids) == count and ids, what=f"{count} dead rows"
    )
