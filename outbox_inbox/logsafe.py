"""Masking of credentials in URLs, for everything that is printed or logged."""

from __future__ import annotations

import re

_USERINFO = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]*)@"
)


def mask_url(url: str | None) -> str:
    """Return `url` with its password replaced by `***`; None becomes an empty string."""
    if not url:
        return ""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)
