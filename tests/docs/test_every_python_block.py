"""Every Python block of README.md and docs/ runs as written, or says on the page why not.

getting-started.md and the README's tour have runners of their own (test_getting_started.py,
test_readme_tour.py), which run every block against real servers. Every other page's Python
blocks run here, in order, in one namespace per page, in a fresh directory; a block the page
marks ``<!-- not run: REASON -->`` (an excerpt of the user's own code, or one that needs an
exporter or a web app that is not there) must still be valid Python and give its reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from .markdown_run import Block, parse_blocks

ROOT = Path(__file__).resolve().parents[2]
#: Pages whose every block a runner of its own executes against real servers.
OWN_RUNNERS = {"docs/getting-started.md", "README.md"}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(page: Path) -> list[Block]:
    return [b for b in parse_blocks(page.read_text()) if b.lang == "python"]


PAGES = [p for p in _pages() if _python_blocks(p)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_python_block_is_valid_and_runs_or_says_why_not(page: Path, tmp_path: Path) -> None:
    name = page.relative_to(ROOT).as_posix()
    blocks = _python_blocks(page)
    runnable = []
    for block in blocks:
        where = f"{name}:{block.line}"
        try:
            ast.parse(block.text)
        except SyntaxError as exc:
            raise AssertionError(f"{where}: not valid Python: {exc}") from None
        reason = block.marker("not run")
        if reason is not None:
            assert reason, f"{where}: `not run` needs a reason"
            continue
        if name not in OWN_RUNNERS:
            runnable.append(block)
    if not runnable:
        return
    program = "\n".join(f"# {name}:{b.line}\n{b.text}" for b in runnable)
    ran = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, f"{name}: its blocks failed:\n{ran.stderr[-3000:]}"
