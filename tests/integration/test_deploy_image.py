"""The scripts the image runs: its entrypoint and its health check, run here as they run in
a container (with `baton` and `getent` stood in by small fakes on PATH, and a loopback
HTTP server standing in for a baton process)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"
HEALTHCHECK = DOCKER / "healthcheck.py"


def _fake_bin(folder: Path, address: str) -> Path:
    """`baton` that prints its arguments and BATON_* environment; `getent` that resolves
    any name to `address`."""
    folder.mkdir()
    (folder / "baton").write_text(
        '#!/bin/sh\necho "args: $*"\nenv | grep "^BATON_" | sort\n', encoding="utf-8"
    )
    (folder / "getent").write_text(
        f'#!/bin/sh\necho "{address}      STREAM $2"\n', encoding="utf-8"
    )
    for tool in ("baton", "getent"):
        (folder / tool).chmod(0o755)
    return folder


def _entrypoint(
    tmp_path: Path, address: str, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    fake = _fake_bin(tmp_path / "bin", address)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    clean["PATH"] = f"{fake}:{clean.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_entrypoint_runs_baton_and_drops_empty_settings(tmp_path: Path) -> None:
    out = _entrypoint(
        tmp_path,
        "172.18.0.5",
        "prefill",
        "--port",
        "9000",
        BATON_PAGE_SIZE="",
        BATON_API_KEY="",
        BATON_MODEL="/models/m",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "args: prefill --port 9000"
    # empty means "baton's default": the variable must not reach baton at all
    assert lines[1:] == ["BATON_MODEL=/models/m"]


def test_entrypoint_resolves_auto_to_the_container_address(tmp_path: Path) -> None:
    out = _entrypoint(
        tmp_path, "172.18.0.5", "decode", BATON_HOST="auto", BATON_ADVERTISE_HOST="auto"
    )
    assert out.returncode == 0, out.stderr
    assert "BATON_ADVERTISE_HOST=172.18.0.5" in out.stdout.splitlines()
    assert "BATON_HOST=172.18.0.5" in out.stdout.splitlines()


def test_entrypoint_refuses_to_advertise_loopback(tmp_path: Path) -> None:
    # e.g. host networking, where the host name maps to 127.0.1.1: peers could not use it
    out = _entrypoint(tmp_path, "127.0.1.1", "decode", BATON_ADVERTISE_HOST="auto")
    assert out.returncode == 2
    assert "BATON_ADVERTISE_HOST" in out.stderr and "args:" not in out.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        _Health.status = 200


def _healthcheck(port: int, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    # a proxy that does not exist: the check must never go through one
    clean.update(http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    clean.update(BATON_HEALTHCHECK_PORT=str(port), **env)
    out = subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=clean, capture_output=True, timeout=20
    )
    return out.returncode


def test_healthcheck_follows_the_health_endpoint(health_server: http.server.HTTPServer) -> None:
    port = health_server.server_address[1]
    assert _healthcheck(port) == 0
    assert _healthcheck(port, BATON_HEALTHCHECK_HOST="0.0.0.0") == 0  # bound everywhere
    _Health.status = 503  # a draining worker, or a router with no usable pair
    assert _healthcheck(port) == 1
    assert _healthcheck(port, BATON_HEALTHCHECK_PATH="/nope") == 1


def test_healthcheck_tcp_mode_for_the_bootstrap() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert _healthcheck(port, BATON_HEALTHCHECK_PATH="tcp") == 0
    assert _healthcheck(port, BATON_HEALTHCHECK_PATH="tcp") == 1  # closed now
