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
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cluster import Cluster, cluster
from tests.integration.faults import (
    ExtraWorkers,
    StreamResult,
    alive,
    busy_worker_freezer,
    descendants,
    metric,
    pid_in_log,
    pid_of_baton,
    steady_load,
    stream_completion,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

LEASE_TTL = 2.0
PROMPTS = [f"Fault {i}: the quick brown fox jumps over the lazy dog" for i in range(6)]
TOKENS = 160  # per stream: long enough to be mid-stream when the fault hits
LONG = 400  # the acceptance stream


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, ExtraWorkers]]:
    tmp = tmp_path_factory.mktemp("faults")
    grace = "10"
    with cluster(tmp, "--prefill", "1", "--decode", "1", "--stop-grace", grace) as c:
        extra = ExtraWorkers(c, c.log_dir)
        try:
            yield c, extra
        finally:
            extra.stop()
        # Stopping `baton up` stops every process it started (restarted ones included)
        # within its grace period.
        started = descendants(c.proc.pid)
        c.proc.send_signal(signal.SIGTERM)
        took = wait_until(
            lambda: not any(alive(pid) for pid in started), float(grace) + 2, "baton up stops all"
        )
        print(f"baton up stopped {len(started)} processes in {took:.1f}s")


@pytest.fixture(scope="module")
def reference(pd: tuple[Cluster, ExtraWorkers]) -> dict[tuple[str, int], str]:
    """Greedy outputs of uninterrupted runs, before any fault (run together, as the faulted
    streams are: greedy output does not depend on the batch)."""
    c, _ = pd

    def complete(prompt: str, tokens: int) -> str:
        body = {
            "model": model(c),
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        status, answer = c.post("/v1/completions", body, timeout=120)
        assert status == 200, answer
        return str(answer["choices"][0]["text"])

    runs = [*((p, TOKENS) for p in PROMPTS), (PROMPTS[0], LONG)]
    with ThreadPoolExecutor(len(runs)) as pool:
        texts = list(pool.map(lambda run: complete(*run), runs))
    return dict(zip(runs, texts, strict=True))


def model(c: Cluster) -> str:
    return Path(c.model).name


async def streams_with_fault(
    c: Cluster, prompts: list[str], tokens: int, fault: Any, after_tokens: int = 2
) -> list[StreamResult]:
    """Stream `prompts` at once; run `fault()` (in a thread) once every stream still going
    has `after_tokens` chunks (two: its decode has begun); return every result. Not more:
    the client reads its chunks behind the workers, and at eight a lightly loaded decode
    worker had once finished every stream before the fault could find one (a full suite run
    on a 2-core machine, 2026-11-26)."""
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


def faulted_streams(
    c: Cluster, prompts: list[str], tokens: int, fault: Any, victims: list[str], **kw: Any
) -> list[StreamResult]:
    """`streams_with_fault` again until the fault found a stream to hit (it appends to
    `victims`): the client reads its chunks behind the workers, and on a loaded 2-core
    machine every stream had once ended before the fault looked (CI, 2026-11-27)."""
    for _ in range(3):
        results = asyncio.run(streams_with_fault(c, prompts, tokens, fault, **kw))
        if victims:
            return results
        print("  the streams ended before the fault could find one: again")
    raise AssertionError("in three rounds the fault never found a stream to hit")


def assert_exact(results: list[StreamResult], reference: dict[Any, str], tokens: int) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} failed: {[r.error for r in failed]}"
    for r in results:
        assert r.text == reference[r.prompt, tokens], f"stream of {r.prompt!r} diverged"


def live_decodes(c: Cluster, extra: ExtraWorkers) -> dict[str, int]:
    """worker id -> frontend pid of every decode worker alive: `baton up`'s and the test's."""
    pids = {worker_id_in_log(c, "decode-0"): pid_in_log(c, "decode-0")}
    pids.update({n: p.pid for n, p in extra.procs.items() if n.startswith("d")})
    return {worker: pid for worker, pid in pids.items() if alive(pid)}


def leave_within_the_lease(c: Cluster, worker_id: str) -> None:
    """A killed worker leaves the registry (and routing) once its lease lapses."""
    gone = wait_until(
        lambda: worker_id not in {w.worker_id for w in c.workers()},
        LEASE_TTL + 5,
        f"{worker_id} leaves the registry",
    )
    print(f"  {worker_id} left the registry {gone:.1f}s after the streams ended")


def test_decode_scheduler_dies(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    extra.start("d1", "decode")
    extra.wait_registered("d1")
    decodes = live_decodes(c, extra)
    migrations = metric(c, 'baton_router_reruns_total{kind="migration"}')
    victims: list[str] = []
    freeze = busy_worker_freezer(c, decodes)

    def kill() -> None:
        if (picked := freeze()) is None:
            return
        victim, scheduler = picked
        os.kill(scheduler, signal.SIGKILL)  # the frontend lives on
        victims.append(victim)

    results = faulted_streams(c, PROMPTS, TOKENS, kill, victims)
    (victim,) = victims
    assert_exact(results, reference, TOKENS)
    # The frontend does not outlive its scheduler: it fails its streams, deregisters, exits.
    gone = wait_until(lambda: not alive(decodes[victim]), 15, f"{victim}'s frontend exits")
    log = "decode-0.log" if victim not in extra.procs else f"{victim}.log"
    assert "scheduler process exited unexpectedly" in (c.log_dir / log).read_text()
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
    decodes = live_decodes(c, extra)
    assert len(decodes) >= 2
    victims: list[str] = []
    freeze = busy_worker_freezer(c, decodes)

    def kill() -> None:
        if (picked := freeze()) is None:
            return
        victim, scheduler = picked
        os.kill(decodes[victim], signal.SIGKILL)
        os.kill(scheduler, signal.SIGCONT)  # it finds its frontend gone and exits
        victims.append(victim)

    results = faulted_streams(c, [PROMPTS[0]], LONG, kill, victims, after_tokens=40)
    assert_exact(results, reference, LONG)
    (result,) = results
    print(f"decode SIGKILL at token ~40 of {LONG}: stream whole, max stall {result.max_gap:.2f}s")
    assert result.max_gap < 10
    leave_within_the_lease(c, victims[0])
    c.wait_idle(timeout=30)


def test_decode_stopped_past_its_lease(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    extra.start("d3", "decode")
    extra.wait_registered("d3")
    decodes = live_decodes(c, extra)
    stopped: list[str] = []
    freeze = busy_worker_freezer(c, decodes)

    def stop_one() -> None:
        if (picked := freeze()) is None:
            return
        victim, scheduler = picked
        os.kill(decodes[victim], signal.SIGSTOP)  # the whole worker, as a paused machine
        stopped.append(victim)
        time.sleep(LEASE_TTL + 1.5)  # past the lease: the router drops it
        os.kill(decodes[victim], signal.SIGCONT)
        os.kill(scheduler, signal.SIGCONT)

    results = faulted_streams(c, PROMPTS, TOKENS, stop_one, stopped)
    (victim,) = stopped
    assert_exact(results, reference, TOKENS)
    stall = max(r.max_gap for r in results)
    print(f"decode SIGSTOP {LEASE_TTL + 1.5:.1f}s: 0 failed, max stall {stall:.2f}s")
    assert stall < LEASE_TTL + 5
    # Resumed, it registers again; what it held for the moved streams is freed.
    wait_until(lambda: victim in {w.worker_id for w in c.workers()}, 20, "re-registration")
    c.wait_idle(timeout=30)


def test_prefill_killed(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, extra = pd
    extra.start("p1", "prefill")
    extra.wait_registered("p1")
    prefill = pid_in_log(c, "prefill-0")
    victim = worker_id_in_log(c, "prefill-0")

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
    leave_within_the_lease(c, victim)
    c.wait_idle(timeout=30)


def test_bootstrap_frozen_past_the_lease_drops_nobody(pd: tuple[Cluster, ExtraWorkers]) -> None:
    # A VM pause or a swap storm: the bootstrap stops (SIGSTOP) for twice the lease ttl and
    # goes on. Every lease looks lapsed by its clock, but nobody could be heard meanwhile:
    # no worker may leave the router's view, no request fail, /health stay 200 throughout.
    c, _ = pd
    bootstrap = pid_of_baton("bootstrap", c.registry.rsplit(":", 1)[1])
    members = {w.worker_id for w in c.workers()}
    wait_until(lambda: set(_health(c)[1]) == members, 10, "the router sees every member")
    frozen_for = 2 * LEASE_TTL + 1
    seen: list[tuple[int, list[str]]] = []
    router_log = c.log_dir / "router.log"
    logged_before = len(router_log.read_text())

    def watch_health(until: float) -> None:
        while time.monotonic() < until:
            seen.append(_health(c))
            time.sleep(0.05)

    async def run() -> list[StreamResult]:
        watch_until = time.monotonic() + 1 + frozen_for + 3 * LEASE_TTL
        watcher = asyncio.create_task(asyncio.to_thread(watch_health, watch_until))
        load = asyncio.create_task(
            steady_load(c.url, model(c), PROMPTS, 16, 3.0, frozen_for + 2 * LEASE_TTL)
        )
        await asyncio.sleep(1)
        os.kill(bootstrap, signal.SIGSTOP)
        try:
            await asyncio.sleep(frozen_for)
        finally:
            os.kill(bootstrap, signal.SIGCONT)
        results = await load
        await watcher
        return results

    results = asyncio.run(run())
    failed = [r.error for r in results if not r.ok]
    unhealthy = [status for status, _ in seen if status != 200]
    views = {tuple(ids) for _, ids in seen}
    print(
        f"bootstrap SIGSTOP {frozen_for:.0f}s (ttl {LEASE_TTL:.0f}s): {len(failed)} of "
        f"{len(results)} failed, {len(unhealthy)} of {len(seen)} health checks not 200"
    )
    assert failed == []
    assert unhealthy == []
    assert views == {tuple(sorted(members))}, f"the router's view changed: {views}"
    # Polling /health can miss a drop of a few ms (without the fix: 13 ms, then the workers
    # registered again); the router logs every worker that leaves its view.
    left = [
        ln for ln in router_log.read_text()[logged_before:].splitlines() if ln.endswith(" left")
    ]
    assert left == [], f"the router dropped workers: {left}"
    assert {w.worker_id for w in c.workers()} == members
    assert "a stall" in (c.log_dir / "bootstrap.log").read_text()


def test_bootstrap_restart_under_load_fails_nothing(
    pd: tuple[Cluster, ExtraWorkers], reference: Any
) -> None:
    c, _ = pd
    port = c.registry.rsplit(":", 1)[1]
    old = pid_of_baton("bootstrap", port)
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
    wait_until(lambda: pid_of_baton("bootstrap", port) != old, 10, "restarted")
    wait_until(lambda: {w.worker_id for w in c.workers()} == before, 10, "re-registered")
    c.wait_idle(timeout=30)


# Seconds from a router's death to a request served again (issue 42 item 10: 26 s on a loaded
# 2-core machine, 8-11 s idle, from a cold start). baton up's warm spare takes over instead:
# no imports or tokenizer load remain, only the supervisor's poll (0.2 s), the bind, uvicorn's
# start-up and the registry's snapshot - 0.3-0.6 s here - so 5 s holds on a loaded machine.
SERVES_AGAIN_S = 5.0


def test_router_restart_under_load(pd: tuple[Cluster, ExtraWorkers], reference: Any) -> None:
    c, _ = pd
    old = pid_of_baton("router", c.port)
    wait_until(lambda: _spare_loaded(c), 90, "baton up's spare router has loaded")
    killed_at = served_again = 0.0

    async def first_served_after_the_kill() -> None:
        nonlocal served_again
        body = {"model": model(c), "prompt": "again", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=c.url) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    r = await client.post("/v1/completions", json=body, timeout=2)
                    if r.status_code == 200:
                        served_again = time.monotonic()
                        return
                await asyncio.sleep(0.05)

    async def run() -> list[StreamResult]:
        nonlocal killed_at
        load = asyncio.create_task(steady_load(c.url, model(c), PROMPTS, 24, 4.0, 6.0))
        await asyncio.sleep(1.5)
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)  # baton up starts it again on the same port
        await asyncio.wait_for(first_served_after_the_kill(), 60)
        return await load

    results = asyncio.run(run())
    print(f"router SIGKILL: a request served again {served_again - killed_at:.2f}s later")
    assert served_again - killed_at < SERVES_AGAIN_S
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


def _health(c: Cluster) -> tuple[int, list[str]]:
    """The router's /health status and the worker ids it routes to (0: no answer)."""
    try:
        r = httpx.get(c.url + "/health", timeout=1)
    except httpx.HTTPError:
        return 0, []
    return r.status_code, sorted(r.json().get("worker_ids", []))


def _spare_loaded(c: Cluster) -> bool:
    """baton up's spare router (its pid in router.log) is alive and waiting to take over."""
    pids = re.findall(
        r"standby router loaded \(pid (\d+)\)", (c.log_dir / "router.log").read_text()
    )
    return bool(pids) and alive(int(pids[-1]))


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
