"""Tools of the fault matrix: streaming clients that record what a user would see, extra
workers joined to a running cluster, and process surgery (find, kill, stop)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.integration.cluster import Cluster


@dataclass
class StreamResult:
    """One streamed completion, as its client saw it."""

    prompt: str
    text: str = ""
    tokens: int = 0
    error: str | None = None  # an SSE error event, an HTTP error, a broken connection
    started: float = 0.0
    ended: float = 0.0
    max_gap: float = 0.0  # longest wait between two chunks (a stall)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


async def stream_completion(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float = 60,
    result: StreamResult | None = None,
) -> StreamResult:
    """Stream one greedy completion; `result` (if given) fills in as chunks arrive."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    result = result or StreamResult(prompt)
    result.started = last = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                result.max_gap = max(result.max_gap, now - last)
                last = now
                result.chunk_times.append(now)
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    break
                for choice in event.get("choices", []):
                    result.text += choice.get("text", "")
                    result.tokens += 1
    except (httpx.HTTPError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.ended = time.monotonic()
    return result


async def steady_load(
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    rate: float,
    duration: float,
    headers: dict[str, str] | None = None,
) -> list[StreamResult]:
    """Streams at `rate` requests/s for `duration` s (prompts in turn); every result."""
    async with httpx.AsyncClient(base_url=url, headers=headers) as client:
        tasks = []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < duration:
            prompt = prompts[i % len(prompts)]
            tasks.append(asyncio.create_task(stream_completion(client, model, prompt, max_tokens)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        return list(await asyncio.gather(*tasks))


def metric(cluster: Cluster, name: str) -> float:
    """The sum of a router metric's samples whose line starts with `name`."""
    with httpx.Client(base_url=cluster.url) as client:
        text = client.get("/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class ExtraWorkers:
    """Workers started by the test into a running cluster (baton up does not know them)."""

    def __init__(self, cluster: Cluster, log_dir: Path) -> None:
        self.cluster = cluster
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, role: str, *flags: str) -> subprocess.Popen[bytes]:
        registry = self.cluster.registry
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        cmd = [
            sys.executable, "-m", "baton.services.cli", role,
            "--model", self.cluster.model, "--registry", registry,
            "--heartbeat-interval", "0.5", "--lease-ttl", "2", "--worker-id", name, *flags,
        ]  # fmt: skip
        env = {**os.environ, "BATON_CLUSTER_TOKEN": self.cluster.token}
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def wait_registered(self, *names: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not set(names) <= {w.worker_id for w in self.cluster.workers()}:
            for name in names:
                proc = self.procs[name]
                assert proc.poll() is None, f"{name} exited: {self.logs(name)}"
            assert time.monotonic() < deadline, f"{names} did not register"
            time.sleep(0.2)

    def logs(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pid_in_log(cluster: Cluster, name: str) -> int:
    """The pid a process of `baton up` reported in its log (workers print it when ready)."""
    text = (cluster.log_dir / f"{name}.log").read_text()
    pids = re.findall(r"BATON_WORKER_PID=(\d+)", text)
    assert pids, f"no pid in {name}.log"
    return int(pids[-1])


def pid_of_baton(command: str, port: int | str) -> int:
    """The newest `baton <command> ... --port <port>` process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "baton.services.cli" not in argv or command not in argv:
            continue
        if any(a == "--port" and b == str(port) for a, b in itertools.pairwise(argv)):
            found.append(int(entry.name))
    assert found, f"no process runs baton {command} --port {port}"
    return max(found, key=lambda pid: os.stat(f"/proc/{pid}").st_mtime)


def busy_worker_freezer(
    cluster: Cluster, frontends: dict[str, int]
) -> Callable[[], tuple[str, int]]:
    """A function that stops (SIGSTOP) the scheduler of every worker in `frontends` (worker
    id -> frontend pid) at once, picks the one whose frontend holds the most open streams,
    lets the others go on (SIGCONT), and returns its worker id and scheduler pid; the caller
    faults that worker, then kills or continues its scheduler. None (every scheduler goes
    on) when no worker holds a stream any more.

    Free of races: the streams are counted while no scheduler can end one (a 160-token
    stream takes a second; looking first and stopping after missed them). What it needs is
    looked up now, so that it stops the schedulers within a millisecond of being called."""
    addresses = {w.worker_id: w.http_address for w in cluster.workers()}
    schedulers = {worker: scheduler_pid(pid) for worker, pid in frontends.items()}

    def open_streams(client: httpx.Client, worker: str) -> int:
        text = client.get(f"http://{addresses[worker]}/metrics").text
        (line,) = (ln for ln in text.splitlines() if ln.startswith("baton_worker_streams "))
        return int(float(line.split()[1]))

    def freeze() -> tuple[str, int] | None:
        for scheduler in schedulers.values():
            os.kill(scheduler, signal.SIGSTOP)
        chosen = ""
        try:
            time.sleep(0.3)  # outputs sent before the stop reach the frontends
            with httpx.Client(timeout=10) as client:
                streams = {worker: open_streams(client, worker) for worker in schedulers}
            busiest = max(streams, key=lambda worker: streams[worker])
            if streams[busiest] == 0:
                return None
            chosen = busiest
            return chosen, schedulers[chosen]
        finally:
            for worker, scheduler in schedulers.items():
                if worker != chosen:
                    os.kill(scheduler, signal.SIGCONT)

    return freeze


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> set[int]:
    """Every process `pid` started, and theirs, alive now."""
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def scheduler_pid(worker_pid: int) -> int:
    """The scheduler process a worker frontend started (a spawned multiprocessing child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == worker_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"worker {worker_pid} has no scheduler process")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(predicate: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}"
        time.sleep(0.05)
    return time.monotonic() - start
