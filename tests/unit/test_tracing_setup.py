"""Where a Service's spans go: its own tracer provider, else the global one once it is set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from outbox_inbox import Service

URL = "postgresql+psycopg://user@127.0.0.1:1/none"


def test_a_given_tracer_provider_is_used_and_a_no_op_one_means_tracing_is_off() -> None:
    assert Service("billing", db_url=URL, tracer_provider=TracerProvider()).tracing.tracer()
    noop = Service("billing", db_url=URL, tracer_provider=trace.NoOpTracerProvider())
    assert noop.tracing.tracer() is None


def test_the_global_provider_is_followed_from_the_moment_it_is_set() -> None:
    # In a process of its own: a global tracer provider cannot be unset.
    script = textwrap.dedent(
        f"""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from outbox_inbox import Service

        service = Service("billing", db_url={URL!r})
        assert service.tracing.tracer() is None
        trace.set_tracer_provider(TracerProvider())
        assert service.tracing.tracer() is not None
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.stdout.strip() == "ok", result.stderr
