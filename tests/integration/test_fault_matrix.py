"""The fault matrix: real processes (`baton up`, 1P1D, lease ttl 2 s) and the faults an
unlucky operator meets, each under live streaming load. For every fault the test asserts
what a user would notice: requests failed, how long a stream stalled or took to get its
error, and the KV pages still held once the cluster is quiet (none may leak).

One cluster serves the whole module; each fault adds the worker it is about to lose, so
that the cluster stays whole for the next one. Greedy outputs are compared with those of
an uninterrupted run: a stream whose worker is lost continues on another, token-exact.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cluster import Cluster, cluster
from tests.integration.faults import (
    ExtraWorkers,
    StreamResult,
    alive,
    metric,
    pid_in_log,
    pid_of_command,
    scheduler_pid,
    steady_load,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

LEASE_TTL = 2.0
PROMPTS = [f"Fault {i}: the quick brown fox jumps over the lazy dog" for i in range(6)]
TOKENS = 96  # per stream: long enough to be mid-stream when the fault hits
LONG = 400  # the acceptance stream


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ExtraWorkers]]:
    tmp = tmp_path_factory.mktemp("faults")
    with cluster(tmp, "--prefill", "1", "--decode", "1", "--stop-grace", "10") as c:
        extra = ExtraWorkers(c, c.log_dir)
        try:
            yield c, extra
        finally:
            extra.stop()


@pytest.fixture(scope="module")
def reference(pd: tuple[Cluster, ExtraWorkers]) -> dict[tuple[str, int], str]:
    """Greedy outputs of uninterrupted runs, before any fault."""
    c, _ = pd
    out = {}
    for prompt, tokens in [*((p, TOKENS) for p in PROMPTS), (PROMPTS[0], LONG)]:
        body = {
            "model": Path(c.model).name,
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        status, answer = c.post("/v1/completions", body, timeout=120)
        assert status == 200, answer
        out[prompt, tokens] = answer["choices"][0]["text"]
    return out


def model(c: Cluster) -> str:
    return Path(c.model).name


async def streams_with_fault(
    c: Cluster, prompts: list[str], tokens: int, fault: Any, after_tokens: int = 8
) -> list[StreamResult]:
    """Stream `prompts` at once; run `fault()` (in a thread) once every stream still going
    has `after_tokens` chunks; return every result."""
    results = [StreamResult(p) for p in prompts]
    async with httpx.AsyncClient(base_url=c.url) as client:
        tasks = [
            asyncio.create_task(stream_completion(client, model(c), r.prompt, tokens, 120, r))
            for r in results
        ]
        while not all(t.done() for t in tasks):
            live = [r for r, t in zip(results, tasks, strict=True) if not t.done()]
            if all(len(r.chunk_times) >= after_tokens for r in live):
                await asyncio.to_thread(fault)
                break
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    return results


def decode_running(c: Cluster) -> dict[str, int]:
    return {
        w.worker_id: c.worker_stats(w.grpc_address).running
        for w in c.workers()
        if w.role == 3  # DECODE
    }


def assert_exact(results: list[StreamResult], reference: dict[Any, str], tokens: int) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} failed: {[r.error for r in failed]}"
    for r in results:
        assert r.text == reference[r.prompt, tokens], f"stream of {r.prompt!r} diverged"


def test_decode_scheduler_dies(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    extra.start("d1", "decode")
    extra.wait_registered("d1")
    frontend = pid_in_log(c, "decode-0")
    scheduler = scheduler_pid(frontend)
    victim = worker_id_in_log(c, "decode-0")
    migrations = metric(c, 'baton_router_reruns_total{kind="migration"}')

    def kill() -> None:
        wait_until(lambda: decode_running(c).get(victim, 0) > 0, 10, f"{victim} busy")
        os.kill(scheduler, signal.SIGKILL)

    results = asyncio.run(streams_with_fault(c, PROMPTS, TOKENS, kill))
    assert_exact(results, reference, TOKENS)
    # The frontend does not outlive its scheduler: it fails its streams, deregisters, exits.
    gone = wait_until(lambda: not alive(frontend), 15, "decode-0's frontend exits")
    assert "scheduler process exited unexpectedly" in (c.log_dir / "decode-0.log").read_text()
    stall = max(r.max_gap for r in results)
    print(f"decode scheduler SIGKILL: 0 failed, max stall {stall:.2f}s, frontend gone {gone:.1f}s")
    assert stall < 10
    assert metric(c, 'baton_router_reruns_total{kind="migration"}') > migrations
    c.wait_idle(timeout=30)


def test_decode_killed_mid_stream_keeps_the_greedy_output(
    pd: tuple[Cluster, ExtraWorkers], reference: Any
) -> None:
    # The acceptance case: 1P2D, the decode worker streaming a 400-token greedy response is
    # SIGKILLed; the client's stream stays whole and equal to the uninterrupted output.
    c, extra = pd
    extra.start("d2", "decode")
    extra.wait_registered("d2")

    def kill() -> None:
        wait_until(lambda: any(decode_running(c).values()), 10, "a decode worker busy")
        victim = next(w for w, n in decode_running(c).items() if n > 0)
        extra.procs[victim].kill()

    results = asyncio.run(streams_with_fault(c, [PROMPTS[0]], LONG, kill, after_tokens=40))
    assert_exact(results, reference, LONG)
    (result,) = results
    print(f"decode SIGKILL at token ~40 of {LONG}: stream whole, max stall {result.max_gap:.2f}s")
    assert result.max_gap < 10
    c.wait_idle(timeout=30)


def test_decode_stopped_past_its_lease(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    survivor = next(n for n in ("d1", "d2") if extra.procs[n].poll() is None)
    extra.start("d3", "decode")
    extra.wait_registered("d3")
    stopped: list[str] = []

    def stop_one() -> None:
        wait_until(lambda: decode_running(c).get(survivor, 0) > 0, 10, f"{survivor} busy")
        os.kill(extra.procs[survivor].pid, signal.SIGSTOP)
        stopped.append(survivor)
        time.sleep(LEASE_TTL + 1.5)  # past the lease: the router drops it
        os.kill(extra.procs[survivor].pid, signal.SIGCONT)

    results = asyncio.run(streams_with_fault(c, PROMPTS, TOKENS, stop_one))
    assert stopped
    assert_exact(results, reference, TOKENS)
    stall = max(r.max_gap for r in results)
    print(f"decode SIGSTOP {LEASE_TTL + 1.5:.1f}s: 0 failed, max stall {stall:.2f}s")
    assert stall < LEASE_TTL + 5
    # Resumed, it registers again; what it held for the moved streams is freed.
    wait_until(lambda: survivor in {w.worker_id for w in c.workers()}, 20, "re-registration")
    c.wait_idle(timeout=30)


def test_prefill_killed(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    extra.start("p1", "prefill")
    extra.wait_registered("p1")
    prefill = pid_in_log(c, "prefill-0")

    def kill() -> None:
        os.kill(prefill, signal.SIGKILL)

    results = asyncio.run(streams_with_fault(c, PROMPTS, TOKENS, kill, after_tokens=1))
    assert_exact(results, reference, TOKENS)
    # New requests go to the other prefill worker at once (the dead one fails fast).
    started = time.monotonic()
    status, _ = c.post(
        "/v1/completions", {"model": model(c), "prompt": "after", "max_tokens": 4}, timeout=60
    )
    print(
        f"prefill SIGKILL: 0 failed, max stall {max(r.max_gap for r in results):.2f}s, "
        f"next request {time.monotonic() - started:.2f}s"
    )
    assert status == 200
    c.wait_idle(timeout=30)


def test_bootstrap_restart_under_load_fails_nothing(
    pd: tuple[Cluster, ExtraWorkers], reference: Any
) -> None:
    c, _ = pd
    port = c.registry.rsplit(":", 1)[1]
    old = pid_of_command(f"bootstrap --port {port}")
    before = {w.worker_id for w in c.workers()}

    async def run() -> list[StreamResult]:
        load = asyncio.create_task(steady_load(c.url, model(c), PROMPTS, 24, 4.0, 6.0))
        await asyncio.sleep(1.5)
        os.kill(old, signal.SIGKILL)  # baton up starts it again, empty
        return await load

    results = asyncio.run(run())
    failed = [r.error for r in results if not r.ok]
    print(f"bootstrap restart at 4 req/s: {len(failed)} of {len(results)} failed")
    assert failed == []
    wait_until(lambda: pid_of_command(f"bootstrap --port {port}") != old, 10, "restarted")
    wait_until(lambda: {w.worker_id for w in c.workers()} == before, 10, "re-registered")
    c.wait_idle(timeout=30)


def test_router_restart_under_load(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, _ = pd
    old = pid_of_command(f"router --port {c.port}")
    killed_at = 0.0

    async def run() -> list[StreamResult]:
        nonlocal killed_at
        load = asyncio.create_task(steady_load(c.url, model(c), PROMPTS, 24, 4.0, 6.0))
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)  # baton up starts it again on the same port
        return await load

    results = asyncio.run(run())
    back = wait_until(lambda: _healthy(c), 60, "the router is back") + time.monotonic()
    failed = [r for r in results if not r.ok]
    # Only requests the dead router held, or sent while it was down, fail - and at once.
    for r in failed:
        assert r.started < back, f"a request sent after the restart failed: {r.error}"
        assert r.ended - max(r.started, killed_at) < 5, "a failure took long to be seen"
    print(
        f"router SIGKILL at 4 req/s: {len(failed)} of {len(results)} failed, "
        f"back after {back - killed_at:.1f}s"
    )
    c.wait_idle(timeout=30)  # the workers freed what the dead router's streams held
    status, _ = c.post("/v1/completions", {"model": model(c), "prompt": "x", "max_tokens": 4})
    assert status == 200


def _healthy(c: Cluster) -> bool:
    try:
        return httpx.get(c.url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def worker_id_in_log(c: Cluster, name: str) -> str:
    """The worker id `baton up`'s worker `name` registered under (its log says it)."""
    text = (c.log_dir / f"{name}.log").read_text()
    match = re.search(r"worker (\S+) \(\w+\) serving gRPC", text)
    assert match, f"no worker id in {name}.log"
    return match.group(1)
