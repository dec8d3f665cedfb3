"""Wake-up channel names stay within what PostgreSQL's NOTIFY takes (63 bytes)."""

from __future__ import annotations

from outbox_inbox.waker import helpers_channel, notify_channel


def test_the_helpers_channel_is_named_after_its_channel_and_never_longer_than_notify_takes() -> (
    None
):
    assert helpers_channel("outbox_inbox.inbox_messages") == "outbox_inbox.inbox_messages.helpers"
    long = notify_channel("tenant_" + "x" * 40, "inbox_messages")
    named = helpers_channel(long)
    assert len(named.encode()) <= 63
    assert named != helpers_channel(notify_channel("tenant_" + "y" * 40, "inbox_messages"))
    assert helpers_channel(long) == named  # every process derives the same name
