"""`free_port` hands out ports no outgoing connection can take while their server is down."""

from __future__ import annotations

import socket
from pathlib import Path

from outbox_inbox.testing.servers import LOCALHOST, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_free() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port < low for port in ports), [p for p in ports if p >= low]
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOCALHOST, port))  # free now
