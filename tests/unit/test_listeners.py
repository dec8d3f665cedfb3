"""Several listeners as one: every hook reaches each of them, whatever another one raises."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from outbox_inbox.listener import Listener, Listeners, combine
from outbox_inbox.messages import Message

HOOKS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "relay_confirmed": (([], []), {}),
    "relay_committed": (([],), {}),
    "received": ((1, 0), {}),
    "stored": (([],), {}),
    "handler_ran": ((None, 0.1, None), {}),
    "handled": ((None,), {}),
    "failed": ((None, RuntimeError("x")), {"dead": True}),
    "dead": (("rejected", 2), {}),
}


class Recording(Listener):
    def __init__(self) -> None:
        self.heard: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattribute__(self, name: str) -> Any:
        if name in HOOKS:
            return lambda *args, **kwargs: self.heard.append((name, args, kwargs))
        return super().__getattribute__(name)


class Raising(Listener):
    def __getattribute__(self, name: str) -> Any:
        if name in HOOKS:

            def hook(*args: Any, **kwargs: Any) -> None:
                raise ValueError(f"{name} broke")

            return hook
        return super().__getattribute__(name)


def test_every_hook_reaches_every_listener_after_one_that_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    message = Message(message_id=uuid.uuid4(), type="a.b.c", payload={})
    first, last = Recording(), Recording()
    both = Listeners(first, Raising(), last)
    with caplog.at_level(logging.ERROR, logger="outbox_inbox.listener"):
        for name, (args, kwargs) in HOOKS.items():
            args = tuple(message if a is None else a for a in args)
            getattr(both, name)(*args, **kwargs)
    assert [h[0] for h in first.heard] == list(HOOKS) == [h[0] for h in last.heard]
    assert first.heard[-1] == ("dead", ("rejected", 2), {})
    assert first.heard[6][2] == {"dead": True}
    assert sum("broke" in r.getMessage() or r.exc_info is not None for r in caplog.records) == len(
        HOOKS
    )


def test_combine_leaves_out_none_and_wraps_only_several() -> None:
    one = Listener()
    assert combine(None, None) is None
    assert combine(None, one) is one
    several = combine(one, Listener())
    assert isinstance(several, Listeners) and len(several.listeners) == 2
