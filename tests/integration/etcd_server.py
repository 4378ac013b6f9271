"""A real etcd server for tests: Debian's `etcd-server` package on free loopback ports.

scripts/setup.sh installs it when it is missing (apt-get); where it cannot be installed the
tests that need it skip, saying so. One server serves a whole test session (the
`etcd_server` fixture in conftest.py); each test works under a key prefix of its own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from tests.integration.cluster import free_port

NOT_INSTALLED = (
    "etcd is not installed: scripts/setup.sh installs Debian's etcd-server package with "
    "apt-get, which failed or was not allowed here"
)


class EtcdServer:
    """One etcd member. stop()/start() keep its ports and data: a restart, not a new store."""

    def __init__(self, data_dir: Path, binary: str = "etcd", **flags: str) -> None:
        self.data_dir = data_dir
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.flags = flags
        self.scheme = "https" if "cert-file" in flags else "http"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # once: later starts are restarts, on the same ports

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str | None = None) -> str:
        """An etcd:// registry URL under `prefix` (default: a fresh one)."""
        return f"etcd://{self.endpoint}{prefix or '/test-' + uuid.uuid4().hex[:8]}"

    def start(self, timeout: float = 30) -> None:
        """Start etcd and wait until it serves. A first start whose free ports were taken
        meanwhile (another process on this machine bound one between `free_port` and
        etcd's bind) tries fresh ports; a restart keeps its ports, as a restart must."""
        first = not self.started
        for _ in range(3 if first else 1):
            exited = self._start_once(timeout)
            if exited is None:
                self.started = True
                return
            log_text = exited.read_bytes() if exited.exists() else b""
            if not (first and b"address already in use" in log_text):
                break
            self.client_port, self.peer_port = free_port(), free_port()
        raise RuntimeError(f"etcd exited: see {exited}")

    def _start_once(self, timeout: float) -> Path | None:
        """None once etcd serves; the path of its log when it exited."""
        client = f"{self.scheme}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name=baton-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=baton-test={peer}",
            *(f"--{k}={v}" for k, v in self.flags.items()),
        ]
        log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while not self._serving():
            if self.proc.poll() is not None:
                self.proc = None
                return log_path
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not serving within {timeout}s: see {log_path}")
            time.sleep(0.1)
        return None

    def _serving(self) -> bool:
        if self.scheme == "https":  # /health needs the CA; a TCP connect is enough here
            import socket

            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.client_port), timeout=1),
            ):
                return True
            return False
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


def etcd_binary() -> str | None:
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None
    )
