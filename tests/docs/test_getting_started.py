"""docs/getting-started.md works as written: its blocks run in order against real servers.

The page's own conventions (files, commands, outputs, background processes) are those of
`markdown_run`; the run itself is the package's `reader_project` fixture (conftest.py), which
the other pages continue from.
"""

from __future__ import annotations

import pytest

from .conftest import GETTING_STARTED, Project
from .markdown_run import parse_blocks

pytestmark = pytest.mark.integration


def test_getting_started_runs_as_written_on_real_servers(reader_project: Project) -> None:
    run = reader_project.run
    print("\n".join(run.log))
    if reader_project.error is not None:
        print(run.background_logs())
        raise reader_project.error
    assert run.background, "the page starts the services' roles"
    codes = reader_project.exit_codes
    assert all(code == 0 for code in codes.values()), (codes, run.background_logs())


def test_the_page_runs_the_commands_it_shows() -> None:
    """Every shell, console and Python block of the page is run or written: only the
    installation and the server containers are fragments."""
    blocks = parse_blocks(GETTING_STARTED.read_text(encoding="utf-8"))
    fragments = [block for block in blocks if block.marker("fragment") is not None]
    assert [block.text.splitlines()[1].split()[0] for block in fragments] == ["python3", "docker"]
    files = [block.marker("file") for block in blocks if block.marker("file")]
    assert files == ["billing/app.py", "orders/app.py", "place_order.py", "dev.py"]
