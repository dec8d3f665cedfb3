"""HTML built with every value escaped: the dashboard's only way to write a page.

`html(template, *values)` escapes each value (quotes included) unless it is `Safe`, the result
of an earlier `html` call; nothing else produces `Safe`. A value therefore reaches the page as
text, whatever it holds: a payload, a header, an error, a message id, a query parameter."""

from __future__ import annotations

from collections.abc import Iterable
from html import escape


class Safe(str):
    """Text already escaped, or markup built by `html` from escaped values."""

    __slots__ = ()


def text(value: object) -> Safe:
    """`value` as HTML text (None as an empty string)."""
    if isinstance(value, Safe):
        return value
    return Safe(escape("" if value is None else str(value), quote=True))


def html(template: str, *values: object) -> Safe:
    """`template` with each ``{}`` replaced by the escaped value; the template is trusted."""
    return Safe(template.format(*(text(v) for v in values)))


def join(parts: Iterable[Safe]) -> Safe:
    """Concatenate pieces of markup."""
    return Safe("".join(text(p) for p in parts))
