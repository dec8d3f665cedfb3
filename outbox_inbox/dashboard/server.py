"""Serving the dashboard: the standard library's WSGI server, one thread per request."""

from __future__ import annotations

import logging
import socket
import socketserver
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .app import Dashboard
from .security import check_bind

log = logging.getLogger(__name__)


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's idle keep-alive connection does not block the stop
    allow_reuse_address = True


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    """Logs each request through `logging` (not stderr), without its query string, which may
    hold message ids and filters the operator typed."""

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        path, client = self.path.split("?", 1)[0], self.address_string()
        log.info("%s %s %s %s", client, self.command, path, code, extra={"status": code})


def make_dashboard_server(
    dashboard: Dashboard, host: str = "127.0.0.1", port: int = 8089
) -> WSGIServer:
    """A server for `dashboard` on `host`:`port` (0: any free port), bound and ready for
    `serve_forever()`; `server.server_address` has the port. Raises ConfigurationError when
    `host` is not a loopback address and the dashboard has no token (see security.py), and
    OSError naming `host`:`port` when the address cannot be bound (taken, not this machine's)."""
    check_bind(host, dashboard.guard.token)
    server_class = _IPv6ThreadingServer if ":" in host else _ThreadingServer
    bare = host.strip("[]")
    try:
        return make_server(bare, port, dashboard, server_class=server_class, handler_class=_Handler)
    except OSError as exc:
        where = f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
        raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror or exc}") from exc
