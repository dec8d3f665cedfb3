"""The dead-letter filters are declared once (`FILTER_FIELDS`): every command that takes
filters offers each as an option, the dashboard's form shows each that has an example, and
both read what a user gives into the same `Filters`."""

from __future__ import annotations

from datetime import timedelta

import pytest
from click.testing import CliRunner

from outbox_inbox.cli.main import main
from outbox_inbox.dashboard.app import BadRequest, parse_filters
from outbox_inbox.dashboard.views import filter_form
from outbox_inbox.dead_letters import FILTER_FIELDS, FilterError, Filters

COMMANDS = ("list", "count", "replay", "purge", "park")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_filter_is_an_option_of_every_command_that_filters(command: str) -> None:
    shown = CliRunner().invoke(main, ["dead-letters", command, "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert [f.flag for f in FILTER_FIELDS if f"--{f.flag} " not in shown.output] == []


def test_the_form_shows_every_filter_with_an_example_and_reads_it_back() -> None:
    form = str(filter_form("billing", ["table"], {}))
    on_form = [f for f in FILTER_FIELDS if f.example]
    assert [f.key for f in on_form if f'name="{f.key}"' not in form] == []
    query = {"type": "orders.#, billing.invoice.*", "older_than": "2h", "reason": "rejected"}
    assert parse_filters(query) == Filters(
        types=("orders.#", "billing.invoice.*"), older_than=timedelta(hours=2), reason="rejected"
    )
    with pytest.raises(BadRequest, match="not a duration"):
        parse_filters({"older_than": "soon"})


def test_a_filter_that_does_not_read_names_itself() -> None:
    assert Filters.read({"message_ids": ["A1", ""], "parked": True}) == Filters(
        message_ids=("A1",), parked=True
    )
    with pytest.raises(FilterError) as bad:
        Filters.read({"older_than": "soon"})
    assert bad.value.flag == "older-than"
    with pytest.raises(FilterError) as bad:
        Filters.read({"types": ["a..b"]})
    assert bad.value.flag == "type"
