"""Loopback sockets for servers started in-process (benchmarks, test harnesses).

Binding before the server starts gives the caller the port without a race. The socket
must be created with ``proto=IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` only on
transports whose socket says so, and an accepted connection inherits the listening
socket's ``proto``. A plain ``socket.socket()`` (proto 0) leaves Nagle's algorithm on,
so a response written in two parts (uvicorn writes the head, then the body) waits for
the client's delayed ACK — about 40 ms on Linux, on every request.
"""

from __future__ import annotations

import socket


def loopback_listener() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1, for ``uvicorn.Server.serve(sockets=[...])``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.bind(("127.0.0.1", 0))
    except OSError:
        sock.close()
        raise
    return sock
