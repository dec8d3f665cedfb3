"""The dashboard's pieces that need no server: rates, escaping, the bind and Host rules."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox_inbox.dashboard import Guard, check_bind
from outbox_inbox.dashboard.markup import html
from outbox_inbox.dashboard.rates import RateTracker
from outbox_inbox.dashboard.views import trace_id
from outbox_inbox.errors import ConfigurationError

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _status(at: float, processed: int, dead: int = 0, pending: int = 0) -> dict[str, Any]:
    return {
        "database_time": (T0 + timedelta(seconds=at)).isoformat(),
        "outbox": {"unpublished": 0, "dead": 0},
        "inbox": {"processed": processed, "dead": dead, "pending": pending, "in_progress": 0},
    }


def test_rates_are_the_change_per_second_between_snapshots_and_none_when_a_counter_fell() -> None:
    rates = RateTracker(window=300)
    assert rates.add("billing", _status(0, 100)) is None  # one snapshot: no rate yet
    later = rates.add("billing", _status(10, 150, dead=2, pending=5))
    assert later is not None
    assert (later.span, later.processed, later.dead, later.backlog) == (10, 5.0, 0.2, 0.5)
    archived = rates.add("billing", _status(20, 40))  # rows archived: processed went down
    assert archived is not None and archived.processed is None and archived.span == 20
    assert rates.add("shipping", _status(20, 7)) is None  # each service on its own


def test_every_value_is_escaped_in_markup_quotes_included() -> None:
    page = html('<a title="{}">{}</a>', '"><script>x</script>', "<b>&</b>")
    assert (
        page == '<a title="&quot;&gt;&lt;script&gt;x&lt;/script&gt;">&lt;b&gt;&amp;&lt;/b&gt;</a>'
    )
    assert html("<p>{}</p>", html("<b>{}</b>", "<i>")) == "<p><b>&lt;i&gt;</b></p>"


def test_a_trace_id_is_read_from_a_valid_traceparent_only() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id({"traceparent": good}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": good.encode()}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": "<script>"}) is None
    assert trace_id({}) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"])
def test_loopback_addresses_are_served_without_a_token(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.0.2.7"])
def test_other_addresses_need_a_token_of_16_characters(host: str) -> None:
    with pytest.raises(ConfigurationError, match="not a loopback address"):
        check_bind(host, None)
    with pytest.raises(ConfigurationError, match="at least 16"):
        check_bind(host, "short")
    check_bind(host, "x" * 16)


def test_host_header_must_be_a_loopback_literal_without_a_token() -> None:
    guard = Guard()
    for host in ("127.0.0.1:8089", "localhost:8089", "[::1]:8089", "localhost"):
        assert guard.host_allowed({"HTTP_HOST": host}), host
    for host in ("attacker.example:8089", "10.0.0.1", "", "127.0.0.1.attacker.example"):
        assert not guard.host_allowed({"HTTP_HOST": host}), host
    assert Guard(token="t" * 16).host_allowed({"HTTP_HOST": "dash.example.org"})


def test_basic_auth_takes_the_token_as_password_and_names_the_user() -> None:
    guard = Guard(token="t" * 20)

    def basic(text: str) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(text.encode()).decode()}

    assert guard.user(basic("ada:" + "t" * 20)) == "ada"
    assert guard.user(basic("ada:" + "t" * 19)) is None
    assert guard.user({"HTTP_AUTHORIZATION": "Bearer " + "t" * 20}) == "token"
    assert guard.user({"HTTP_AUTHORIZATION": "Basic !!!"}) is None
    assert guard.user({}) is None
    assert Guard().user({}) == "local"
