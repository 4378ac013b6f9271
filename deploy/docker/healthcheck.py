#!/usr/bin/env python3
"""The image's health check: exit 0 when this container's baton process answers.

It asks http://$BATON_HEALTHCHECK_HOST:$BATON_HEALTHCHECK_PORT$BATON_HEALTHCHECK_PATH and
wants a 200 (the router's /health: a usable worker pair exists; a worker's /health on its
--metrics-port: up and not draining). BATON_HEALTHCHECK_PATH=tcp means a TCP connect is
enough: the bootstrap speaks gRPC only. The host is where the process binds: `auto` (the
container's own address, as the entrypoint resolves it), or 0.0.0.0 / unset (loopback).
Standard library only; never through a proxy.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def target_host(configured: str) -> str:
    if configured == "auto":
        return socket.gethostbyname(socket.gethostname())
    if configured in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return configured


def main() -> int:
    host = target_host(os.environ.get("BATON_HEALTHCHECK_HOST", ""))
    port = int(os.environ.get("BATON_HEALTHCHECK_PORT") or "8000")
    path = os.environ.get("BATON_HEALTHCHECK_PATH") or "/health"
    if path == "tcp":
        try:
            socket.create_connection((host, port), timeout=TIMEOUT_S).close()
        except OSError as e:
            print(f"unhealthy: tcp {host}:{port}: {e}", file=sys.stderr)
            return 1
        return 0
    url = f"http://{host}:{port}{path}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=TIMEOUT_S) as resp:
            return 0 if resp.status == 200 else 1
    except urllib.error.HTTPError as e:
        print(f"unhealthy: {url}: HTTP {e.code}", file=sys.stderr)
    except OSError as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
