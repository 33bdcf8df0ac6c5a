"""kvledger.net: in-process servers answer without waiting on Nagle's algorithm."""

from __future__ import annotations

import asyncio
import socket

from kvledger.net import loopback_listener


async def test_connections_accepted_on_a_loopback_listener_have_nodelay():
    accepted: asyncio.Queue[int] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        await accepted.put(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    listener = loopback_listener()
    host, port = listener.getsockname()
    assert host == "127.0.0.1" and port > 0
    server = await asyncio.start_server(on_connect, sock=listener)
    async with server:
        _, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(accepted.get(), 10) != 0
        writer.close()
        await writer.wait_closed()
