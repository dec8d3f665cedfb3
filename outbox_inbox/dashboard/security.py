"""Who may use the dashboard and from where: the bind check, authentication, CSRF, Host, by
the rules of docs/dashboard.md ("Who can reach it"). Tokens are compared in constant time."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
import socket
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigurationError

#: The shortest token accepted: a guessable token is no protection.
MIN_TOKEN_LENGTH = 16
CSRF_COOKIE = "outbox_inbox_csrf"
CSRF_FIELD = "csrf"

Environ = dict[str, Any]


def is_loopback_host(host: str) -> bool:
    """True when `host` (an address or a name) means this machine only.

    A name counts only when every address it resolves to is a loopback address."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses
    )


def check_bind(host: str, token: str | None) -> None:
    """Raise ConfigurationError when serving on `host` would expose an unprotected dashboard,
    or when the token is too short to protect it."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigurationError(
            f"the dashboard token must be at least {MIN_TOKEN_LENGTH} characters long"
        )
    if token is None and not is_loopback_host(host):
        raise ConfigurationError(
            f"refusing to serve the dashboard on {host}, which is not a loopback address, "
            "without a token: set OUTBOX_INBOX_DASHBOARD_TOKEN (or --token-file), or bind to "
            "127.0.0.1"
        )


def _host_name(host_header: str) -> str:
    """The host part of a Host header (``[::1]:8080`` -> ``::1``, ``a:80`` -> ``a``)."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")] if "]" in host_header else host_header
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


@dataclass
class Guard:
    """The checks every request goes through (see the module docstring)."""

    token: str | None = None
    _key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def user(self, environ: Environ) -> str | None:
        """Who is asking: the Basic user name, ``token`` for a bearer token, ``local`` without
        a token configured; None when the request is not authenticated."""
        if self.token is None:
            return "local"
        header = str(environ.get("HTTP_AUTHORIZATION", ""))
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() == "bearer" and self._matches(credentials.strip()):
            return "token"
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
            name, sep, password = decoded.partition(":")
            if sep and self._matches(password):
                return name or "token"
        return None

    def _matches(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode("utf-8"), self.token.encode("utf-8"))

    def host_allowed(self, environ: Environ) -> bool:
        """Without a token, only a loopback Host header is served (DNS rebinding)."""
        if self.token is not None:
            return True
        name = _host_name(str(environ.get("HTTP_HOST") or "")).lower()
        # Names are not resolved here: a rebound name resolves to 127.0.0.1 by design.
        if name == "localhost":
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def csrf_cookie(self, environ: Environ) -> str | None:
        """The browser's CSRF cookie, when it sent a well-formed one."""
        try:
            cookies = SimpleCookie(str(environ.get("HTTP_COOKIE", "")))
        except CookieError:
            return None
        morsel = cookies.get(CSRF_COOKIE)
        value = morsel.value if morsel is not None else ""
        return value if 20 <= len(value) <= 100 and value.isascii() else None

    @staticmethod
    def new_cookie() -> tuple[str, tuple[str, str]]:
        """A new CSRF cookie value, and the header that gives it to the browser."""
        value = secrets.token_urlsafe(32)
        return value, ("Set-Cookie", f"{CSRF_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict")

    def csrf_token(self, cookie: str) -> str:
        """The form token that goes with `cookie`."""
        return hmac.new(self._key, cookie.encode("ascii"), hashlib.sha256).hexdigest()

    def csrf_problem(self, environ: Environ, form_token: str | None) -> str | None:
        """Why a POST fails the CSRF check; None when it passes."""
        origin = environ.get("HTTP_ORIGIN")
        if origin is not None:
            host = str(environ.get("HTTP_HOST") or "")
            parts = urlsplit(str(origin))
            if origin == "null" or parts.netloc != host:
                return f"the form was sent from another origin ({origin})"
        cookie = self.csrf_cookie(environ)
        if cookie is None:
            return "the form was sent without the dashboard's cookie; reload the page"
        if not form_token or not hmac.compare_digest(form_token, self.csrf_token(cookie)):
            return "the form's token does not match; reload the page"
        return None
