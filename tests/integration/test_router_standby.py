"""A standby router (`baton router --standby`, the warm spare `baton up` keeps): it loads
everything without taking the port, takes it only when told (a line on stdin), and exits when
its keeper is gone (EOF) rather than lingering."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.cluster import free_port

pytestmark = pytest.mark.timeout(120)


def standby_router(port: int, model: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BATON_CLUSTER_TOKEN": "standby-test-token-0123456789"}
    argv = ["router", "--standby", "--model", str(model), "--port", str(port)]
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "baton.services.cli", *argv],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            env=env,
        )


def wait_loaded(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while "waiting to take over" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the standby router did not load"
        time.sleep(0.1)


def answers(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    except httpx.HTTPError:
        return False
    return True


def test_a_standby_router_takes_the_port_only_when_told(tmp_path: Path, tiny_model: Path) -> None:
    port, log = free_port(), tmp_path / "router.log"
    proc = standby_router(port, tiny_model, log)
    try:
        wait_loaded(proc, log)
        assert not answers(port)  # loaded, but the port is the running router's
        assert proc.stdin is not None
        proc.stdin.write(b"serve\n")
        proc.stdin.close()
        told = time.monotonic()
        while not answers(port):
            assert proc.poll() is None, log.read_text()
            time.sleep(0.02)
        took = time.monotonic() - told
        print(f"a loaded standby router answered {took:.2f}s after it was told")
        assert took < 5  # no imports nor loading left: binding and uvicorn's start-up
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_standby_router_exits_when_its_keeper_is_gone(tmp_path: Path, tiny_model: Path) -> None:
    port, log = free_port(), tmp_path / "router.log"
    proc = standby_router(port, tiny_model, log)
    try:
        wait_loaded(proc, log)
        assert proc.stdin is not None
        proc.stdin.close()  # as when baton up dies
        assert proc.wait(timeout=30) == 0
        assert not answers(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
