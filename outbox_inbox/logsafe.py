"""Masking of credentials in URLs, for everything that is printed or logged."""

from __future__ import annotations

import re

# A user and password after a scheme, in well-formed URLs and in the ways people mistype them:
# "scheme://", "scheme//" (a missing colon), "//", "scheme:". The password runs to the last "@"
# of the word, so a raw "/" or "@" in it is masked too: better too much than a password.
_USERINFO = re.compile(
    r"(?P<scheme>(?:[a-zA-Z][a-zA-Z0-9+.\-]*:?)?//|[a-zA-Z][a-zA-Z0-9+.\-]*:)"
    r"(?P<user>[^:/@\s]*):(?P<pw>\S*)@(?=[^@\s]*(?:\s|$))"
)


def mask_url(url: str | None) -> str:
    """Return `url` (or any text holding URLs) with every password replaced by `***`.

    Works on malformed URLs too (a missing ":" after the scheme, a raw "/" or "@" in the
    password). None becomes an empty string.
    """
    if not url:
        return ""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", str(url))
