"""Control-plane servers close connections that never complete their handshake."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from baton.common.rpc import auth

pytestmark = pytest.mark.timeout(30)


async def test_a_trickling_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    options = dict(auth.SERVER_OPTIONS)
    assert options["grpc.server_handshake_timeout_ms"] <= 10_000  # what production uses
    options["grpc.server_handshake_timeout_ms"] = 500  # the same rule, faster
    monkeypatch.setattr(auth, "SERVER_OPTIONS", tuple(options.items()))
    server = auth.make_server("token")
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    try:
        sock.send(b"PRI * HTTP/2.0\r\n")  # the first bytes of the preface, then nothing
        started = time.monotonic()
        while await asyncio.wait_for(loop.sock_recv(sock, 4096), 10):
            pass  # the server's own settings frame may come first
        assert time.monotonic() - started < 5
    finally:
        sock.close()
        await server.stop(None)
