"""`baton up` where another program already listens (issue #42 item 7): it refuses before
starting anything, says why on the console, and never restarts a router that cannot bind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton.services import exits

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def baton(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATON_CLUSTER_TOKEN": "port-test-token-0123456789"}
    return subprocess.run(
        [sys.executable, "-m", "baton.services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_up_on_a_port_in_use_refuses_before_starting_anything(
    taken_port: int, tiny_model: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    start = time.monotonic()
    done = baton(
        "up", "--model", str(tiny_model), "--port", str(taken_port), "--log-dir", str(logs)
    )
    assert done.returncode == 2, done
    assert time.monotonic() - start < 30
    assert f"--port {taken_port}" in done.stderr and "not free" in done.stderr, done.stderr
    assert "baton is up" not in done.stdout
    assert not logs.exists() or not list(logs.glob("*.log"))  # no process was started


def test_a_router_that_cannot_bind_says_so_and_exits_with_its_code(
    taken_port: int, tiny_model: Path
) -> None:
    done = baton("router", "--model", str(tiny_model), "--port", str(taken_port))
    assert done.returncode == exits.ADDRESS_IN_USE, done
    assert f"cannot listen on 127.0.0.1:{taken_port}" in done.stderr, done.stderr
