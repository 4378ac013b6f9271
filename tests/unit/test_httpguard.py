"""HTTP connections that send no request, or their headers too slowly, are closed; normal
and keep-alive requests, and long responses, are not cut."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from baton.services.httpguard import guarded_http_protocol
from baton.services.httpserve import bind_socket

pytestmark = pytest.mark.timeout(30)
TIMEOUT = 0.3


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    @api.get("/slow")
    async def slow() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):  # longer than the header timeout, in all
                await asyncio.sleep(TIMEOUT / 2)
                yield b"x"

        return StreamingResponse(chunks())

    return api


async def serve() -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(app(), log_level="warning", http=guarded_http_protocol(TIMEOUT))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def closed_after(port: int, send: list[bytes], pause: float) -> float:
    """Seconds until the server closes a raw connection that sends `send`, one piece
    every `pause` seconds."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    start = time.monotonic()
    try:
        for piece in send:
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # still open
            sock.send(piece)
            await asyncio.sleep(pause)
        data = await asyncio.wait_for(loop.sock_recv(sock, 1024), 5)
        assert data == b""  # closed without a response
        return time.monotonic() - start
    finally:
        sock.close()


async def test_idle_and_slow_header_connections_are_closed() -> None:
    server, task, port = await serve()
    try:
        assert await closed_after(port, [], 0) < TIMEOUT * 4
        # Bytes that trickle in do not extend the deadline: the headers must be complete.
        trickle = [b"GET /ok HTTP/1.1\r\n", b"Host: x\r\n"]
        assert TIMEOUT * 0.9 < await closed_after(port, trickle, TIMEOUT / 3) < TIMEOUT * 4

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/ok")).json() == {"ok": True}
            r = await client.get("/slow")  # a long response is not cut
            assert r.text == "xxxx"
            await asyncio.sleep(TIMEOUT / 3)
            assert (await client.get("/ok")).status_code == 200  # the same connection
    finally:
        server.should_exit = True
        await task
