"""`bench serve` against a real router process expecting two workers (`--expect-workers`),
with fake workers joining and leaving through a real bootstrap: the run is refused while
one is missing, waits for a late one, and is marked partial when one leaves mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from rich.console import Console

from baton.benchmarks.config import BenchConfig
from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.benchmarks.report import print_result
from baton.benchmarks.serve import BenchError, run_benchmark
from baton.common.rpc import baton_pb2 as pb
from baton.services.bootstrap.server import serve as serve_bootstrap
from baton.services.registry.config import RegistryConfig, open_registry
from baton.services.registry.membership import WorkerRegistration
from tests.integration.cluster import free_port

pytestmark = pytest.mark.timeout(120)

TOKEN = "bench-partial-token"


class Fleet:
    """Fake workers that join and leave the registry one at a time."""

    def __init__(self, registry_url: str, script: list[int]) -> None:
        self._registry_url = registry_url
        self._script = script
        self.workers: dict[str, FakeWorker] = {}
        self._registrations: dict[str, WorkerRegistration] = {}

    async def join(self, worker_id: str) -> FakeWorker:
        worker = FakeWorker(worker_id, pb.BOTH, FakeBehavior(script=self._script, delay=0.01))
        await worker.start(cluster_token=TOKEN)
        registry = open_registry(RegistryConfig(self._registry_url), TOKEN, lease_ttl=3.0)
        registration = WorkerRegistration(registry, worker.info(), 0.2)
        await registration.start()
        self.workers[worker_id] = worker
        self._registrations[worker_id] = registration
        return worker

    async def leave(self, worker_id: str) -> None:
        registration = self._registrations.pop(worker_id)
        await registration.stop()  # deregisters: the router sees it leave at once
        await registration.registry.close()

    async def close(self) -> None:
        for worker_id in list(self._registrations):
            await self.leave(worker_id)
        for worker in self.workers.values():
            await worker.stop()


@asynccontextmanager
async def router_expecting(expect: str, script: list[int]) -> AsyncIterator[tuple[str, Fleet]]:
    """A `baton router` process told to expect `expect`, its URL, and a fleet to join it."""
    bootstrap, boot_port = await serve_bootstrap("127.0.0.1", 0, lease_ttl=3.0, cluster_token=TOKEN)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = subprocess.Popen(
        [sys.executable, "-m", "baton.services.cli", "router", "--port", str(port),
         "--registry", f"127.0.0.1:{boot_port}", "--expect-workers", expect,
         "--log-level", "warning"],
        env={**os.environ, "BATON_CLUSTER_TOKEN": TOKEN},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    fleet = Fleet(f"127.0.0.1:{boot_port}", script)
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            deadline = time.monotonic() + 60
            while True:
                assert router.poll() is None, "the router exited"
                try:
                    await client.get("/health")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the router never answered"
                    await asyncio.sleep(0.1)
        yield url, fleet
    finally:
        router.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            router.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGKILL)  # nothing outlives the test
        router.wait()
        await fleet.close()
        await bootstrap.stop()


def workload(url: str, **overrides: object) -> BenchConfig:
    settings: dict[str, object] = dict(
        base_url=url, request_rate=8.0, num_requests=8, input_len=8, output_len=4, seed=1,
        progress=False,
    )  # fmt: skip
    settings.update(overrides)
    return BenchConfig(**settings)  # type: ignore[arg-type]


async def test_a_partial_cluster_is_refused_and_a_late_worker_is_waited_for(
    script: list[int],
) -> None:
    async with router_expecting("both=2", script) as (url, fleet):
        first = await fleet.join("w0")
        started = time.monotonic()
        with pytest.raises(BenchError, match=r"partial cluster: both 1 of 2 workers joined"):
            await run_benchmark(workload(url, cluster_wait_s=1.5))
        assert 1.5 <= time.monotonic() - started < 15
        assert first.requests == []  # refused before a single request was sent

        async def join_late() -> None:
            await asyncio.sleep(1.0)
            await fleet.join("w1")

        late = asyncio.create_task(join_late())
        result = await run_benchmark(workload(url, cluster_wait_s=30))
        await late
    assert result.summary.completed == 8 and result.partial is None
    assert result.cluster is not None
    start, end = result.cluster.start, result.cluster.end
    assert start.workers == {"both": 2, "prefill": 0, "decode": 0}
    assert start.expected == {"both": 2, "prefill": 0, "decode": 0}
    assert start.worker_ids == ["w0", "w1"] and end is not None and end.worker_ids == ["w0", "w1"]
    recorded = result.to_dict()
    assert recorded["partial_cluster"] is None
    assert recorded["cluster"]["start"]["worker_ids"] == ["w0", "w1"]


async def test_a_worker_lost_mid_run_marks_the_run_partial(script: list[int]) -> None:
    async with router_expecting("both=2", script) as (url, fleet):
        await fleet.join("w0")
        await fleet.join("w1")

        async def lose_one() -> None:
            await asyncio.sleep(1.5)
            await fleet.leave("w1")

        loss = asyncio.create_task(lose_one())
        result = await run_benchmark(workload(url, request_rate=4.0, num_requests=14))
        await loss
    assert result.summary.completed > 0
    assert result.partial is not None
    assert "both 2 at the start, 1 during the run" in result.partial
    assert "lost w1" in result.partial
    recorded = result.to_dict()
    assert recorded["partial_cluster"] == result.partial
    assert recorded["cluster"]["end"]["workers"]["both"] == 1
    out = io.StringIO()
    print_result(result, Console(file=out, width=200))
    printed = out.getvalue()
    assert "cluster at the start: both 2 of 2 workers joined" in printed
    assert "partial cluster: both 2 at the start, 1 during the run" in printed
