"""Run a FastAPI app with uvicorn inside an existing event loop, on a bound socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI

from baton.services.httpguard import KEEP_ALIVE_TIMEOUT_S, guarded_http_protocol

_tasks: set[asyncio.Task[None]] = set()  # keep serving tasks referenced


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def start_http(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, int]:
    """Serve `app` in the background; the caller owns signals (uvicorn's are disabled)."""
    sock = bind_socket(host, port)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=guarded_http_protocol(),
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
    )
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    _tasks.add(asyncio.create_task(server.serve(sockets=[sock])))
    return server, sock.getsockname()[1]
