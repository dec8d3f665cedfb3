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


def test_a_not_run_marker_fails_the_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ echo hi\nhi\n```\n\n<!-- not run: why -->\n```bash\nls\n```\n")
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match="<!-- not run --> is gone"):
        run.run_all()
    assert run.log[-1].endswith("$ echo hi")


def test_a_fragment_is_not_run_but_must_parse_and_say_so(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    fragment = "<!-- fragment -->\n```python\n# fragment: a signature\ndef f(x): ...\n```\n"
    page.write_text(fragment)
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    run.run_all()
    assert run.counts == {"fragment": 1}
    for text, error in [
        ("<!-- fragment -->\n```python\ndef f(x): ...\n```\n", "first line"),
        ("<!-- fragment -->\n```python\n# fragment: x\ndef f(:\n```\n", "not valid Python"),
        ("<!-- fragment -->\n```bash\n# fragment: x\nif then\n```\n", "not valid shell"),
    ]:
        page.write_text(text)
        with pytest.raises(AssertionError, match=error):
            PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set()).run_all()


def test_python_blocks_in_a_row_are_one_program_and_must_succeed(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 6\n```\n\ntext\n\n```python\nopen('out', 'w').write(str(x * 7))\n```\n"
        "\n```console\n$ cat out\n42\n```\n\n```python\nraise SystemExit(x)\n```\n"
    )
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match=r"line 16: its Python .* exited 1\n(?s:.*)NameError"):
        run.run_all()  # the last block is a program of its own: no `x` there
    assert (tmp_path / "out").read_text() == "42"
    assert run.counts == {"run": 4}


def test_a_bash_block_is_one_script_that_stops_at_a_failure(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\nn=7\necho $n > seen\nfalse\necho after > later\n```\n")
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match="exited 1"):
        run.run_all()
    assert (tmp_path / "seen").read_text() == "7\n"
    assert not (tmp_path / "later").exists()


def test_a_differing_output_fails_the_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ echo hello\nhello world\n```\n")
    run = PageRun(page, tmp_path, base_env(Path(sys.executable).parent), set())
    with pytest.raises(AssertionError, match="`echo hello` printed\nhello\n"):
        run.run_all()
