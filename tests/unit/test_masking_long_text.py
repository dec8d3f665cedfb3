"""Masking stays linear in the text's length: `dead-letters show` prints whole payloads.

The regular expressions run without releasing the GIL, so a slow one is stopped from outside:
each case runs in a child process with a generous time limit.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import json, sys
from outbox_inbox.logsafe import mask_url
sys.stdout.write(json.dumps(mask_url(sys.stdin.read())))
"""


def _mask_in_a_child(text: str, seconds: float = 20) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=text,
            capture_output=True,
            text=True,
            timeout=seconds,
            check=True,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"mask_url took over {seconds}s on {len(text)} characters: quadratic?"
        ) from None
    result: str = json.loads(done.stdout)
    return result


def test_a_megabyte_payload_without_a_url_is_printed_unchanged_and_at_once() -> None:
    text = json.dumps({"blob": "x" * 1_000_000, "note": "a: b", "mail": "a@b"}, indent=2)
    assert _mask_in_a_child(text) == text


def test_long_words_with_colons_and_at_signs_are_masked_without_backtracking_for_ever() -> None:
    text = "x" * 200_000 + " amqp://user:s3cret@host/ " + "y:" * 50_000 + " a:" + "x:" * 50_000
    masked = _mask_in_a_child(text + "@h")
    assert "s3cret" not in masked and "amqp://user:***@host/" in masked


def test_many_urls_with_spaces_and_no_host_are_masked_in_linear_time() -> None:
    text = "a://u:" + "x " * 150 + "\n" + ("b://u:p q " * 20_000) + " c://user:two words@host/"
    masked = _mask_in_a_child(text)
    assert "two" not in masked and "c://user:***@host/" in masked
