"""The RabbitMQ management HTTP API: what AMQP 0-9-1 cannot tell, bindings and arguments. AMQP has
no way to list bindings or read the arguments a queue was declared with, so `outbox-inbox topology
plan/verify` ask the management plugin when it answers. Standard library only (urllib). Only
`add_vhost` and `delete_vhost` change the broker (the test servers' vhosts)."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from .errors import BrokerError, ConfigurationError
from .logsafe import mask_text, mask_url

#: Port of the management plugin's HTTP listener unless the URL says otherwise.
DEFAULT_MANAGEMENT_PORT = 15672


class ManagementUnavailable(BrokerError):
    """The RabbitMQ management API did not answer (or refused the credentials)."""


def vhost_of(mq_url: str) -> str:
    """The virtual host an AMQP URL names (``/`` when the path is empty), as pika reads it."""
    path = urlsplit(mq_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def default_management_url(mq_url: str) -> str:
    """``http://user:password@host:15672``: the management API next to the broker of `mq_url`. Same
    host and credentials as the AMQP URL (guest/guest when it has none, as pika assumes)."""
    parts = urlsplit(mq_url)
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    user = quote(unquote(parts.username or "guest"), safe="")
    password = quote(unquote(parts.password or "guest"), safe="")
    return f"http://{user}:{password}@{host}:{DEFAULT_MANAGEMENT_PORT}"


class ManagementAPI:
    """Reads exchanges, queues and bindings of one vhost from the management API at `url`. `url` is
    the API's base, e.g. ``http://user:password@rabbit:15672`` (a path prefix is kept, for an API
    behind a proxy). The credentials travel as HTTP basic authentication."""

    def __init__(self, url: str, vhost: str, *, timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"invalid management URL {mask_url(url)}: use http://host:port"
            )
        try:
            port = parts.port
        except ValueError as exc:  # quotes the port, maybe a password: masked, not chained
            raise ConfigurationError(
                f"invalid management URL {mask_url(url)}: {mask_text(exc, url)}"
            ) from None
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        netloc = f"{host}:{port}" if port else host
        self._base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        user = unquote(parts.username or "guest")
        password = unquote(parts.password or "guest")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        self._headers = {"Authorization": f"Basic {token}", "Accept": "application/json"}
        self._vhost, self._timeout = vhost, timeout

    @property
    def description(self) -> str:
        """The API's address, without credentials."""
        return self._base

    def _get(self, *segments: str, method: str = "GET", body: Any = None) -> Any:
        """GET (or `method`, with the JSON `body`) ``/api/<segments>`` (each one quoted); None
        on 404, and for an answer without a body."""
        path = "/".join(quote(s, safe="") for s in segments)
        # The scheme was checked to be http or https in __init__.
        url = f"{self._base}/api/{path}"
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, "Content-Type": "application/json"}
        request = urllib.request.Request(url, data, headers, method=method)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise ManagementUnavailable(
                f"the management API at {self._base} answered HTTP {exc.code} {exc.reason}"
            ) from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise ManagementUnavailable(
                f"the management API at {self._base} did not answer: {reason}"
            ) from exc

    def check(self) -> None:
        """Raise ManagementUnavailable unless the API answers for this vhost."""
        if self._get("vhosts", self._vhost) is None:
            raise ManagementUnavailable(
                f"the management API at {self._base} does not know vhost {self._vhost!r}"
            )

    def add_vhost(self, user: str) -> None:
        """Create this vhost, `user` allowed everything in it (the API's user must be an
        administrator). Raises ManagementUnavailable when it cannot."""
        self._get("vhosts", self._vhost, method="PUT", body={})
        every = {"configure": ".*", "write": ".*", "read": ".*"}
        self._get("permissions", self._vhost, user, method="PUT", body=every)

    def delete_vhost(self) -> None:
        """Delete this vhost with everything in it (nothing when it does not exist)."""
        self._get("vhosts", self._vhost, method="DELETE")

    def exchange(self, name: str) -> dict[str, Any] | None:
        """The exchange `name` (type, durable, auto_delete, arguments), or None if absent."""
        return self._one("exchanges", name)

    def queue(self, name: str) -> dict[str, Any] | None:
        """The queue `name` (durable, auto_delete, arguments, messages...), or None if absent."""
        return self._one("queues", name)

    def _one(self, kind: str, name: str) -> dict[str, Any] | None:
        found = self._get(kind, self._vhost, name)
        return dict(found) if found is not None else None

    def queue_bindings(self, name: str) -> list[dict[str, Any]]:
        """Bindings whose destination is queue `name`, without the default exchange's."""
        found = self._get("queues", self._vhost, name, "bindings") or []
        return [dict(b) for b in found if b.get("source")]
