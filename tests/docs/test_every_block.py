"""Every code block of README.md and docs/ runs as written on real servers, or is a fragment.

- docs/getting-started.md runs once for the package (``reader_project``, conftest.py), checked
  by test_getting_started.py; every other page continues from the project it leaves.
- A block marked ``<!-- run by: PATH -->`` is run by that test: README.md's tour (it runs a
  service until SIGTERM and is talked to), docs/security.md's grants (with names of its own).
- Every other page runs here, its blocks in order (markdown_run), in a copy of the reader's
  project, with getting-started's environment pointed at the session's servers.

A block is run, written to a file a later block runs, the environment block (checked, given the
test's values), run by another test, or a deliberate fragment (parsed, not run).
``test_every_block_is_run_or_a_fragment`` counts them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from .conftest import PAGE_ENVIRONMENT, Project
from .markdown_run import RUNNABLE, Block, PageRun, parse_blocks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def how_taken(page: Path, block: Block) -> str | None:
    """How the page's run takes `block` (as `PageRun.run_block` does), None if not code."""
    if block.lang not in RUNNABLE and block.marker("file") is None:
        return None
    if block.marker("not run") is not None:
        return "not run"
    if block.marker("fragment") is not None:
        return "fragment"
    if block.marker("run by") is not None:
        return "elsewhere"
    if block.marker("file") is not None:
        return "written"
    if block.lang != "python" and block.marker("environment") is not None:
        return "environment"
    return "run"


def expected_counts(page: Path) -> Counter[str]:
    taken = (how_taken(page, b) for b in parse_blocks(page.read_text(encoding="utf-8")))
    return Counter(how for how in taken if how is not None)


RUN_HERE = [p for p in PAGES if p != GETTING_STARTED and expected_counts(p)]


@pytest.mark.parametrize("page", RUN_HERE, ids=[_name(p) for p in RUN_HERE])
def test_page_runs_as_written_on_real_servers(
    page: Path, reader_project: Project, tmp_path: Path
) -> None:
    if reader_project.error is not None:
        pytest.fail(
            f"getting-started.md did not run, so no page after it can: {reader_project.error}"
        )
    workdir = reader_project.copy_to(tmp_path / "project")
    run = PageRun(page, workdir, dict(reader_project.env), PAGE_ENVIRONMENT)
    try:
        run.run_all()
    except BaseException:
        run.stop(timeout=10)
        print("\n".join(run.log))
        print(run.background_logs())
        raise
    codes = run.stop()
    print("\n".join(run.log))
    assert all(code == 0 for code in codes.values()), (codes, run.background_logs())
    assert run.counts == expected_counts(page)  # every code block taken, none passed over


def test_every_block_is_run_or_a_fragment(record_testsuite_property: object) -> None:
    """No block is "not run"; every fragment says so on its first line; the counts, printed."""
    totals: Counter[str] = Counter()
    for page in PAGES:
        counts = expected_counts(page)
        totals += counts
        for block in parse_blocks(page.read_text(encoding="utf-8")):
            taken = how_taken(page, block)
            where = f"{_name(page)}:{block.line}"
            assert taken != "not run", f"{where}: run it, or mark a fragment"
            if taken == "fragment":
                assert block.text.startswith("# fragment: "), f"{where}: says not what it is"
    ran = sum(n for how, n in totals.items() if how != "fragment")
    total = sum(totals.values())
    summary = f"{ran} / {total} code blocks run ({dict(sorted(totals.items()))})"
    print(summary)
    record_testsuite_property("docs_blocks_run", ran)  # type: ignore[operator]
    record_testsuite_property("docs_blocks_total", total)  # type: ignore[operator]
