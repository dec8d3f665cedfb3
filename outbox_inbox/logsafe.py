"""Masking of credentials in URLs, for everything that is printed or logged."""

from __future__ import annotations

import contextlib
import logging
import re
from urllib.parse import unquote

_SCHEME = r"[a-zA-Z][a-zA-Z0-9+.\-]*"
#: Characters that may stand right before a URL without a scheme ("u:pw@host").
_BEFORE = r"""(?<![^\s'"(=<,;|\[{])"""

# A user and password, in well-formed URLs and in the ways people mistype them: "scheme://",
# "scheme//" (a missing colon), "scheme:/", "//", or no scheme at all at the start of a word
# ("user:pw@host"; "scheme:user:pw@host" reads so too, and loses its user to the mask). The
# password runs to the last "@" of the word, so a raw "/", ":" or "@" in it is masked too:
# better too much than a password.
_USERINFO = re.compile(
    rf"(?P<scheme>{_SCHEME}(?::/+|//+)|//|{_BEFORE}(?=[^:/@\s]*:(?!//)))"
    r"""(?P<user>[^:/@\s'"\[\]]*):(?P<pw>\S*?)@(?=[^@\s]*(?:\s|$))"""
)

#: Where a host's port may end.
_PORT_END = r"""(?:[/?#\s'")\],;]|$)"""
# A URL with a user and password but no host ("amqp://u:pw", "scheme//u:pw/x"): the host's
# place holds the user, the port's a password, unless it is a number.
_HOSTLESS = re.compile(
    rf"(?P<scheme>{_SCHEME}(?::/+|//+))"
    r"""(?P<user>[^:/@\s'"\[\]?#]+):"""
    rf"(?P<pw>(?!\d+{_PORT_END})[^\s@'\"),;\]]+)(?={_PORT_END})"
)


# A password written with white space in it ("amqp://u:two words@host"), which the word-wise
# patterns would cut at the space: "scheme://user:" then, within one line and at most 400
# characters (a bound, so that no text costs more than linear time), the rest up to an "@"
# followed by a host. Tried only where a scheme starts.
_SPACED = re.compile(
    rf"(?<![a-zA-Z0-9+.\-])(?P<scheme>{_SCHEME}://)"  # from a scheme's start only: linear
    r"""(?P<user>[^:/@\s'"\[\]]*):(?P<pw>[^@\n/]{1,400})@(?=[^@\s/]+)"""
)


def _mask_spaced(match: re.Match[str]) -> str:
    if not any(c.isspace() for c in match["pw"]):
        return match.group()  # no white space: the word-wise patterns mask it
    return f"{match['scheme']}{match['user']}:***@"


def mask_url(url: str | None) -> str:
    """Return `url` (or any text holding URLs) with every password replaced by `***`, in
    malformed URLs too: a missing or half ":" or "//" after the scheme, no scheme, no host
    (``amqp://user:password``), a raw "/", ":", "@" or "%" in the password. None gives ""."""
    if not url:
        return ""
    text = str(url)
    if "://" in text and "@" in text:
        text = _SPACED.sub(_mask_spaced, text)
    # Word by word (no pattern crosses white space), and only words that can hold a
    # password: the patterns backtrack over a word's length, and a long word without ":"
    # (a payload printed by `dead-letters show`) would take time quadratic in its length.
    return _WORD.sub(_mask_word, text)


_WORD = re.compile(r"\S+")


def _mask_word(match: re.Match[str]) -> str:
    word = match.group()
    if ":" not in word:
        return word
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", word) if "@" in word else word
    return _HOSTLESS.sub(lambda m: f"{m['scheme']}{m['user']}:***", text)


def url_passwords(text: str | None) -> set[str]:
    """Every password `mask_url` would hide in `text`: as written, percent-decoded, and its
    pieces between "/", "@", ":" and white space; for a caller that must also hide a password
    where it appears alone (a parser's "invalid port 'secret'" about a URL without a host)."""
    if not text:
        return set()
    found: set[str] = set()

    def keep(match: re.Match[str]) -> str:
        found.add(match["pw"])
        return " "

    def keep_spaced(match: re.Match[str]) -> str:
        masked = _mask_spaced(match)
        if masked != match.group():
            found.add(match["pw"])
        return masked

    for match in _HOSTLESS.finditer(_USERINFO.sub(keep, _SPACED.sub(keep_spaced, str(text)))):
        found.add(match["pw"])
    found |= {unquote(p) for p in found}
    # A parser that splits a malformed URL at "/", "@", ":" or white space quotes a piece of
    # the password (pika: "Port could not be cast to integer value as '<first piece>'").
    found |= {piece for p in found for piece in re.split(r"[/@:\s]", p)}
    found.discard("")
    found.discard("***")
    return found


#: The passwords of every URL this process was given (`remember`), masked wherever they appear.
_secrets: set[str] = set()


def remember(url: str | None) -> None:
    """Mask the password of `url` (as written, decoded, and its pieces: `url_passwords`) in all
    that `mask` sees from now on. Every URL the library validates is remembered."""
    _secrets.update(s for s in url_passwords(url) if len(s) >= 3)


def mask_text(text: object, *urls: str | None) -> str:
    """`text` with URL passwords masked, and every password of `urls` and every password
    `remember`ed wherever it appears: the one mask of all that the library and the CLI print,
    log or raise (libpq's "unexpected spaces found in '<password>'" says nothing of a URL).
    Passwords shorter than 3 characters are only masked inside URLs."""
    masked = mask_url(str(text))
    secrets = _secrets.union(*(url_passwords(url) for url in urls))
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 3:
            masked = masked.replace(secret, "***")
    return masked


#: Loggers whose records are masked when they are made (and theirs below them).
_MASKED_LOGGERS = ("outbox_inbox", "pika", "psycopg", "sqlalchemy", "alembic")
_make_record = logging.getLogRecordFactory()


def _masked_record(*args: object, **kwargs: object) -> logging.LogRecord:
    """A log record as the factory before makes it; of `_MASKED_LOGGERS`, with its message,
    traceback and stack masked before any filter or handler sees them (at every level). A
    message with nothing to mask keeps its template and arguments, which filters match on."""
    record = _make_record(*args, **kwargs)
    if record.name.split(".")[0] in _MASKED_LOGGERS:
        with contextlib.suppress(Exception):  # a bad format: the handler reports it
            message = record.getMessage()
            if (masked := mask_text(message)) != message:
                record.msg, record.args = masked, None
        if record.exc_info:
            record.exc_text = mask_text(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = mask_text(record.stack_info)
    return record


logging.setLogRecordFactory(_masked_record)
