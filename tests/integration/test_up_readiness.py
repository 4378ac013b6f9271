"""`baton up` is up only once every worker it started has joined the router: a worker held
back (SIGSTOP) keeps it waiting, named in its log every few seconds; a worker that never
joins ends the wait with an error naming it; a worker that exits ends it at once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests.integration.cluster import free_port

pytestmark = pytest.mark.timeout(180)


class Up:
    """`baton up` with its own log lines, each with the time it was read."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "baton.services.cli", "up",
            "--port", str(self.port), "--log-dir", str(tmp / "logs"), "--lease-ttl", "2",
            "--stop-grace", "3", "--log-level", "info", *args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float, nth: int = 1) -> tuple[float, re.Match[str]]:
        """The time and match of the `nth` line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.matching(pattern)
            if len(found) >= nth:
                return found[nth - 1]
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} (#{nth}) in {timeout:g} s:\n{self.text()}")

    def matching(self, pattern: str) -> list[tuple[float, re.Match[str]]]:
        return [(t, m) for t, line in list(self.lines) if (m := re.search(pattern, line))]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def pid_of(self, name: str) -> int:
        _, match = self.wait_for(rf"started {name} \(pid (\d+)\)", 60)
        return int(match[1])

    def __enter__(self) -> Up:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # nothing outlives the test
        self.proc.wait()
        self._reader.join(timeout=5)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # baton up may have stopped it for good
        os.kill(pid, signal.SIGCONT)


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_up_waits_for_a_slow_worker_and_names_it(tmp_path: Path) -> None:
    waiting = r"waiting for worker-1 \(1 of 2 workers joined\)"
    with Up(tmp_path, "--workers", "2") as up:
        slow = up.pid_of("worker-1")
        os.kill(slow, signal.SIGSTOP)  # long before it could register
        try:
            first, _ = up.wait_for(waiting, 120)
            second, _ = up.wait_for(waiting, 15, nth=2)
            assert second - first >= 4.0, "the wait is reported every few seconds"
            # every few seconds, not more often (lines from before worker-0 joined aside:
            # a loaded machine starts workers slowly and logs more of those)
            since = [t for t, _ in up.matching("waiting for") if t >= first]
            assert len(since) <= 2 + (time.monotonic() - first) / 4
            assert not up.matching("baton is up")
            code, body = health(up.url)
            assert code == 200  # one worker serves; the body says the cluster is partial
            assert body["status"] == "partial"
            assert body["expected"] == {"both": 2, "prefill": 0, "decode": 0}
            assert body["workers"] == {"both": 1, "prefill": 0, "decode": 0}
        finally:
            resume(slow)
        resumed = time.monotonic()
        up_at, _ = up.wait_for(r"baton is up: ", 90)
        assert up_at > resumed
        code, body = health(up.url)
        assert (code, body["status"], body["workers"]["both"]) == (200, "ok", 2)
        assert all(i.startswith("worker-") for i in body["worker_ids"])


def test_up_times_out_naming_the_worker_that_never_joined(tmp_path: Path) -> None:
    with Up(tmp_path, "--workers", "1", "--startup-timeout", "5") as up:
        stuck = up.pid_of("worker-0")
        os.kill(stuck, signal.SIGSTOP)
        try:
            assert up.proc.wait(timeout=60) == 1
        finally:
            resume(stuck)
        up._reader.join(timeout=5)
        _, error = up.wait_for(r"ERROR up: the cluster was not up within 5s: (.*)", 1)
        assert "worker-0" in error[1], up.text()
        assert not up.matching("baton is up")


def test_up_fails_fast_when_a_worker_exits(tmp_path: Path) -> None:
    with Up(tmp_path, "--workers", "1") as up:
        os.kill(up.pid_of("worker-0"), signal.SIGKILL)
        killed = time.monotonic()
        assert up.proc.wait(timeout=30) == 1
        assert time.monotonic() - killed < 10
        up._reader.join(timeout=5)
        assert up.matching(r"failed to start: worker-0 \(exit -9\) exited"), up.text()
