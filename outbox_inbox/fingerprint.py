"""The fingerprint of why a message died: what groups thousands of dead letters into a few causes. A
handler's exception is fingerprinted by its type and the innermost frame of the user's own code in
its traceback (``TimeoutError at billing/app.py:create_invoice``), a death the library decides by
its reason alone: the table of docs/failures.md ("Dead letters grouped by cause")."""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import HandlerExited, InvalidPayload

if TYPE_CHECKING:
    from .broker import Refusal

#: Where code that is not the user's lives: this package, the standard library, installed packages.
_PATHS = sysconfig.get_paths()
_PLACES = [os.path.dirname(__file__), _PATHS["stdlib"], _PATHS["purelib"], _PATHS["platlib"]]
_NOT_USER = tuple({str(Path(p).resolve()) + os.sep for p in _PLACES})
#: Fingerprints fit the column that holds them.
MAX_LENGTH = 255


def fingerprint(reason: str, cause: BaseException | None = None) -> str:
    """The fingerprint of a death for `reason` (the row's dead reason), caused by `cause` (the
    handler's exception), if any. A payload the library's decoder refused is its reason."""
    if cause is None or isinstance(cause, InvalidPayload):
        return reason[:MAX_LENGTH]
    if isinstance(cause, HandlerExited):
        cause = cause.exit  # the handler's own SystemExit, with its traceback
    found = users_frame(cause)
    name = type(cause).__qualname__
    # The function, not the line: an unrelated edit of the file must not split a group.
    text = f"{name} at {found[0]}:{found[1].name}" if found else name
    return text[:MAX_LENGTH]


def refusal_fingerprint(refusal: Refusal) -> str:
    """The fingerprint of an outbox row the broker refused on its every attempt: its reply
    code, and whether for the message's size (the text names sizes: it would split a group)."""
    size = " message larger than the broker's max_message_size" if refusal.max_body else ""
    return f"refused: {refusal.code}{size}"


def users_frame(error: BaseException) -> tuple[str, traceback.FrameSummary] | None:
    """The innermost frame of `error` in the user's code (not this package's, the standard
    library's, an installed package's or a frozen module's), with its path relative to the
    working directory when under it; None without one."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if path.startswith(_NOT_USER) or frame.filename.startswith("<"):
            continue
        try:
            return str(Path(path).relative_to(Path.cwd())), frame
        except ValueError:
            return path, frame
    return None
