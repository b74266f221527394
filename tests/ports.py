"""Ports of 127.0.0.1 that refuse connections for as long as a test holds them.

The port of a server a test stopped is free again: under pytest-xdist another test process
may start a server of its own there meanwhile (``RedisServer`` takes free ports), and the
"unreachable" address answers. A port held by a socket bound to 127.0.0.1 that does not
listen refuses every connection (``ECONNREFUSED``, as a stopped server's port does), and no
other process can bind it until it is closed: the socket does not set ``SO_REUSEADDR``, so a
redis-server's bind, which does, fails too (``EADDRINUSE``), and the kernel gives the port to
no other bind to port 0. The same socket can ``listen()`` later: the address answers from then
on without ever having been free (``TCPProxy(listener=...)``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["held_port"]


@contextmanager
def held_port() -> Iterator[socket.socket]:
    """A socket bound to a free port of 127.0.0.1, not listening, for the block; closed after it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held
