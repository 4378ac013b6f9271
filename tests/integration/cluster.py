"""Start a real local cluster (`baton up`) for a test, on free loopback ports."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        port: int,
        token: str,
        log_dir: Path,
        model: str,
        registry: str | None = None,
    ) -> None:
        self.proc = proc
        self.port = port
        self.token = token
        self.log_dir = log_dir
        self.model = model
        self.url = f"http://127.0.0.1:{port}"
        self._registry = registry  # --registry given to `baton up`; else its own bootstrap

    @property
    def model_name(self) -> str:
        """The served model name (the model folder's name)."""
        return Path(self.model).name

    def post(
        self,
        path: str,
        body: dict[str, Any],
        timeout: float = 60,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log"))
        )

    @property
    def registry(self) -> str:
        return self._registry or _bootstrap_address(self.log_dir)

    def workers(self) -> list[Any]:
        """WorkerInfo of every registered worker (a snapshot of the registry)."""
        import asyncio

        from baton.services.registry.config import RegistryConfig, open_registry

        async def call() -> list[Any]:
            registry = open_registry(RegistryConfig(self.registry), self.token)
            try:
                return list((await registry.snapshot()).members)
            finally:
                await registry.close()

        return asyncio.run(call())

    def worker_stats(self, grpc_address: str) -> Any:
        import asyncio

        from baton.common.rpc import baton_pb2 as pb
        from baton.common.rpc import baton_pb2_grpc as pbg
        from baton.common.rpc.auth import make_channel

        async def call() -> Any:
            async with make_channel(grpc_address, self.token) as ch:
                # wait_for_ready: a connect that fails transiently (CI once saw "tcp
                # handshaker shutdown" among hundreds of polls) is retried within the timeout
                return await pbg.WorkerStub(ch).Stats(
                    pb.StatsRequest(), timeout=5, wait_for_ready=True
                )

        return asyncio.run(call())

    def worker_pid(self, grpc_address: str) -> int:
        """The frontend pid of the worker listening on `grpc_address` (from its log)."""
        port = grpc_address.rsplit(":", 1)[1]
        for log in self.log_dir.glob("*.log"):
            text = log.read_text()
            if f"grpc=127.0.0.1:{port} " in text:
                for line in text.splitlines():
                    if "BATON_WORKER_PID=" in line:
                        return int(line.split("BATON_WORKER_PID=")[1].split()[0])
        raise AssertionError(f"no pid for {grpc_address}")

    def worker_metric(self, grpc_address: str, series: str) -> float:
        """The sum of the worker's /metrics lines that start with `series` (its HTTP port
        from its ready line), e.g. 'baton_worker_role_items{name="migration_pages_out"'."""
        port = grpc_address.rsplit(":", 1)[1]
        for log in self.log_dir.glob("*.log"):
            for line in log.read_text().splitlines():
                if f"grpc=127.0.0.1:{port} " in line and " http=" in line:
                    http = line.split(" http=")[1].split()[0]
                    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
                        text = r.read().decode()
                    return sum(
                        float(ln.rsplit(" ", 1)[1])
                        for ln in text.splitlines()
                        if ln.startswith(series)
                    )
        raise AssertionError(f"no metrics port for {grpc_address}")

    def wait_idle(self, timeout: float = 20) -> list[Any]:
        """Wait until every worker holds no request and no page; return their stats."""
        from baton.common.rpc import baton_pb2 as pb

        deadline = time.monotonic() + timeout
        while True:
            workers = self.workers()
            stats = [self.worker_stats(w.grpc_address) for w in workers]
            if all(s.running == 0 and s.queued == 0 and s.pages_in_use == 0 for s in stats):
                return stats
            if time.monotonic() > deadline:
                held = "; ".join(  # by role: which side holds them is the first question
                    f"{pb.Role.Name(w.role)} {w.grpc_address}: running {s.running}, queued "
                    f"{s.queued}, pages_in_use {s.pages_in_use}, pages_cached {s.pages_cached}"
                    for w, s in zip(workers, stats, strict=True)
                )
                raise AssertionError(f"workers still hold requests or pages: {held}")
            time.sleep(0.1)


def _bootstrap_address(log_dir: Path) -> str:
    text = (log_dir / "bootstrap.log").read_text()
    marker = "bootstrap listening on "
    line = next(ln for ln in text.splitlines() if marker in ln)
    return line.split(marker)[1].split()[0]


@contextmanager
def cluster(
    tmp: Path,
    *args: str,
    model: str | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    from baton.common.models.tiny import default_model_path

    model = model or str(default_model_path())
    port = free_port()
    token = "test-token-" + os.urandom(4).hex()
    log_dir = tmp / f"cluster-{port}"
    cmd = [
        sys.executable,
        "-m",
        "baton.services.cli",
        "up",
        "--port",
        str(port),
        "--model",
        model,
        "--log-dir",
        str(log_dir),
        "--lease-ttl",
        "2",
        "--log-level",
        "info",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "BATON_CLUSTER_TOKEN": token, **(env or {})},  # never on argv
        start_new_session=True,
    )
    registry = args[args.index("--registry") + 1] if "--registry" in args else None
    c = Cluster(proc, port, token, log_dir, model, registry)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"baton up exited ({proc.returncode}):\n{c.logs()}")
            try:
                # "ok", not "partial": every worker `baton up` started has joined the router
                with urllib.request.urlopen(c.url + "/health", timeout=2) as r:
                    if r.status == 200 and json.loads(r.read())["status"] == "ok":
                        break
            except (OSError, ValueError, http.client.HTTPException):  # not up, or not ours yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not up in {timeout}s:\n{c.logs()}")
            time.sleep(0.1)  # a start is seconds: a poll is cheap beside it
        yield c
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # nothing may outlive the cluster
            os.killpg(proc.pid, signal.SIGKILL)
