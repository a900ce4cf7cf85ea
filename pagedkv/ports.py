"""Free loopback ports for tests, benchmarks and the demo: the one helper the tree uses.

The OS picks an unused port when a socket binds port 0; the socket is closed
before the port is returned, so another process can in principle take it before
the caller binds it (the usual, accepted race of this technique). ``free_ports``
holds all n sockets at once, so the n ports differ; ``free_port_block`` finds n
consecutive ones (services that take base, base+1, ...).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct ports free on `host` right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = LOOPBACK) -> int:
    """One port free on `host` right now."""
    return free_ports(1, host)[0]


def free_port_block(n: int, host: str = LOOPBACK, attempts: int = 100) -> int:
    """A port p with p .. p+n-1 all free on `host` right now."""
    for _ in range(attempts):
        base = free_port(host)
        if base + n >= 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} consecutive free ports found on {host}")
