"""Fault injection: server crashes, cut connections, a broker alarm and a blackholed port while
messages flow between two services (``pytest -m faults``)."""
