"""The page runner compares what matters and refuses a code block it would not run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .markdown_run import PageRun, base_env, matches, parse_blocks


def test_outputs_match_apart_from_times_ids_urls_ages_and_column_widths() -> None:
    expected = (
        "service billing on amqp://***:***@localhost:5672/%2F at 2026-11-21T23:16:39.949689+00:00\n"
        "table   2    455762bb-fbce-47bd-b2da-a7685920eb3c  rejected  3s   1\n"
    )
    actual = (
        "service billing on amqp://***:***@127.0.0.1:33509/t_4f60 at 2027-01-02T03:04:05+00:00\n"
        "table 2 0f0e0d0c-fbce-47bd-b2da-a7685920eb3c rejected 12m 1   \n\n"
    )
    assert matches(expected, actual)
    assert not matches(expected, actual.replace("rejected", "expired"))
    assert not matches(expected, actual.replace(" 1 ", " 2 "))


def test_an_ellipsis_line_stands_for_any_lines_and_within_a_line_for_any_text() -> None:
    expected = "head\n...\nlast ... 7\n"
    assert matches(expected, "head\nlast x 7\n")
    assert matches(expected, "head\none\ntwo\nlast anything here 7\n")
    assert not matches(expected, "head\none\nlast x 8\n")
    assert not matches(expected, "other\nlast x 7\n")


def test_markers_apply_to_the_block_right_after_them() -> None:
    page = (
        "<!-- file: a.py -->\n```python\nprint(1)\n```\n\n"
        "<!-- background -->\nSome prose.\n\n```bash\necho hi\n```\n"
    )
    first, second = parse_blocks(page)
    assert (first.lang, first.marker("file"), first.text) == ("python", "a.py", "print(1)\n")
    assert second.marker("background") is None  # prose came between


def test_a_python_block_neither_written_nor_skipped_fails_the_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ echo hi\nhi\n```\n\n```python\nprint(1)\n```\n")
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match="needs <!-- file: PATH -->"):
        run.run_all()
    assert run.log[-1].endswith("$ echo hi")


def test_a_differing_output_fails_the_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ echo hello\nhello world\n```\n")
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match="`echo hello` printed\nhello\n"):
        run.run_all()
