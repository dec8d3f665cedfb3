"""Starts the session's model checks in the background as soon as the tests are collected.

A test names the simulations it reads with ``@pytest.mark.quint(job, ...)`` and gets them from
the ``quint_runs`` fixture. Every job of the selected tests is started once collection ends, at
the lowest CPU priority (see :class:`model.quint.Background`), and those tests are moved to the
end of the session: the simulations run on the CPU the tests before them leave idle (most of the
suite waits on its servers), and a test waits only for what is not done by its turn.
"""

from __future__ import annotations

import os

import pytest

from model.quint import QUINT, Background, Job

_KEY = pytest.StashKey[Background]()


def _jobs(item: pytest.Item) -> list[Job]:
    return [job for marker in item.iter_markers("quint") for job in marker.args]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "quint(*jobs): the model simulations the test reads")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: bool(_jobs(item)))  # stable: the model checks last


def pytest_collection_finish(session: pytest.Session) -> None:
    jobs = [job for item in session.items for job in _jobs(item)]
    if not jobs or session.config.option.collectonly or not QUINT.exists():
        return
    session.config.stash[_KEY] = Background(jobs, slots=len(os.sched_getaffinity(0)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    background = session.config.stash.get(_KEY, None)
    if background is not None:
        background.close()


@pytest.fixture(scope="session")
def quint_runs(request: pytest.FixtureRequest) -> Background:
    """The session's background simulations."""
    background = request.config.stash.get(_KEY, None)
    if background is None:  # Quint missing: the module's own fixture says so
        pytest.fail(f"{QUINT} is missing: scripts/test installs it (npm ci in spec/)")
    return background
