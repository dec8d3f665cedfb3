"""The web dashboard (`outbox-inbox dashboard`): status, rates and dead letters of services,
and replay / purge with confirmation. See docs/dashboard.md."""

from __future__ import annotations

from .app import Dashboard
from .letters import ActionResult, WatchedService, act
from .security import Guard, check_bind
from .server import make_dashboard_server

__all__ = [
    "ActionResult", "Dashboard", "Guard", "WatchedService", "act", "check_bind",
    "make_dashboard_server",
]  # fmt: skip
