"""Free loopback ports for the node's broker and HTTP instances, and for the tests' servers: ports that stay
out of the kernel's ephemeral range, never the same one twice in one process.

Separate from launcher.py: a port is chosen by the launcher, the fleet and every test that starts a server,
and the rule that keeps it out of the ephemeral range changes for reasons of its own (CI's port races).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICKED_PORTS: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and stays out of the kernel's ephemeral range.

    Binding port 0 hands out an ephemeral port, and the same range supplies the source port of every
    outgoing connection: a node's MQTT or HTTP client can take the port between this call and the
    server's bind (seen in CI: 30 minutes of "port already in use"). Ports below the range are only
    ever taken by an explicit bind. Never the same port twice in one process.
    """
    high = _ephemeral_low() - 1
    low = min(20000, high - 1000)
    for _ in range(200):
        port = random.randint(low, high)
        if port not in _PICKED_PORTS and port_free(port, host):
            _PICKED_PORTS.add(port)
            return port
    with socket.socket() as s:  # a crowded range: fall back to what the kernel offers
        s.bind((host, 0))
        return s.getsockname()[1]
