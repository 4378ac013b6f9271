"""The router with several fake workers: prefill/decode pairing and retries, routing
policies, client disconnects over real HTTP, discovery through a real bootstrap and a real
etcd, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from baton.benchmarks.fake_worker import FakeBehavior, FakeWorker
from baton.common.rpc import baton_pb2 as pb
from baton.common.tokenizer import Tokenizer
from baton.services.bootstrap.server import serve as serve_bootstrap
from baton.services.registry.config import RegistryConfig, open_registry
from baton.services.registry.membership import WorkerRegistration
from baton.services.router.app import create_app
from baton.services.router.config import RouterConfig
from tests.integration.router_api import MODEL, cluster, eventually

pytestmark = pytest.mark.timeout(30)

LAYOUT = pb.KVLayout(model="tiny", page_size=1, dtype="float32", num_layers=2)
OTHER_LAYOUT = pb.KVLayout(model="tiny", page_size=16, dtype="float32", num_layers=2)


def fake(worker_id: str, role: int, script: list[int], **behavior: Any) -> FakeWorker:
    return FakeWorker(worker_id, role, FakeBehavior(script=script, **behavior))


def router(
    tokenizer: Tokenizer,
    workers: list[FakeWorker],
    layouts: dict[str, pb.KVLayout] | None = None,
    **config: Any,
) -> AbstractAsyncContextManager[httpx.AsyncClient]:
    """`router_api.cluster` with each worker's KV layout (`LAYOUT` unless in `layouts`)."""
    chosen = layouts or {}
    return cluster(tokenizer, workers, lambda w: chosen.get(w.worker_id, LAYOUT), **config)


async def complete(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})


def sse(body: str) -> list[Any]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


# -- prefill / decode ---------------------------------------------------------------------


async def test_pd_first_token_from_prefill_then_decode(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    # D answers at once and P late: D's tokens must still wait behind P's first token.
    prefill = fake(
        "p0",
        pb.PREFILL,
        script,
        first_delay=0.2,
        timings=pb.Timings(queue=0.1, prefill=0.2, kv_transfer=0.05),
    )
    decode = fake(
        "d0", pb.DECODE, script, timings=pb.Timings(kv_transfer=0.07, decode_admission=0.3)
    )
    async with router(tokenizer, [prefill, decode]) as client:
        r = await complete(
            client, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    chunks = sse(r.text)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == "Hello"
    assert "".join(texts) == tokenizer.decode(script[:6])
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["baton_timings"] == {
        **chunks[-1]["baton_timings"],
        "prefill_queue": 0.1,
        "prefill_compute": 0.2,
        "kv_transfer": 0.07,
        "decode_admission": 0.3,
    }
    (to_p,), (to_d,) = prefill.requests, decode.requests
    assert to_p.room == to_d.room and to_p.room % 2 == 1
    assert to_p.peer.worker_id == "d0" and to_d.peer.worker_id == "p0"
    assert to_p.peer.kv_control_address == decode.info().kv_control_address
    assert to_d.peer.transfer_address == prefill.info().transfer_address
    assert list(to_p.input_ids) == list(to_d.input_ids)


async def test_pd_is_preferred_over_aggregated(tokenizer: Tokenizer, script: list[int]) -> None:
    both = fake("b0", pb.BOTH, script)
    prefill, decode = fake("p0", pb.PREFILL, script), fake("d0", pb.DECODE, script)
    async with router(tokenizer, [both, prefill, decode]) as client:
        r = await complete(client, max_tokens=3)
    assert r.json()["choices"][0]["text"] == "Hello world,"
    assert both.requests == [] and len(prefill.requests) == len(decode.requests) == 1


async def test_a_prefill_worker_counts_a_request_in_flight_only_until_its_part_ends(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    """P's stream ends with its first token (and its KV); D decodes for a while after. The
    router's count of requests in flight on P (what the cost placement reads as P's queue)
    drops when P's part ends, not when D's last token comes (on 2x H200 an idle P looked
    ~70 requests behind: the cost model predicted 2 s to its first token, for 0.15 s)."""
    prefill = fake("p0", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script, delay=0.15)
    key = {"Authorization": "Bearer admin-key"}
    async with router(tokenizer, [prefill, decode], admin_api_key="admin-key") as client:

        async def in_flight() -> dict[str, int]:
            listing = (await client.get("/admin/workers", headers=key)).json()
            return {w["worker_id"]: w["load"]["in_flight"] for w in listing["workers"]}

        answer = asyncio.create_task(complete(client, max_tokens=6))
        await eventually(lambda: len(decode.requests) == len(prefill.requests) == 1)

        async def p_done() -> bool:
            return await in_flight() == {"p0": 0, "d0": 1}

        await eventually(p_done)  # while D still decodes
        assert not answer.done()
        r = await answer
        assert r.json()["choices"][0]["text"] == tokenizer.decode(script[:6])
        assert await in_flight() == {"p0": 0, "d0": 0}


async def test_pd_first_token_that_finishes_aborts_decode(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    prefill = fake("p0", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script, first_delay=1.0)
    async with router(tokenizer, [prefill, decode]) as client:
        r = await complete(client, max_tokens=1)
        assert r.json()["choices"][0] == {
            **r.json()["choices"][0],
            "text": "Hello",
            "finish_reason": "length",
        }
        # D's call is cancelled once P's token finished the request, and it may be
        # cancelled before it reached D at all: what D must get is the Abort of the request
        # P answered (the same id).
        await eventually(lambda: decode.aborted == [prefill.requests[0].request_id])
        assert all(r.request_id == decode.aborted[0] for r in decode.requests)
    assert prefill.aborted == []


async def test_pd_prefill_failure_retries_on_another_pair(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    broken = fake("p0", pb.PREFILL, script, fail="at_start")
    healthy = fake("p1", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script)
    async with router(tokenizer, [broken, healthy, decode], prefill_policy="round_robin") as client:
        r = await complete(client, max_tokens=5)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(script[:5])
        assert len(broken.requests) == 1 and len(healthy.requests) == 1
        # The failed attempt's decode side was told to drop its room.
        first_id = broken.requests[0].request_id
        await eventually(lambda: first_id in decode.aborted)
        retry = healthy.requests[0]
        assert retry.request_id != first_id and retry.room != broken.requests[0].room


async def test_pd_decode_failure_after_output_is_an_error(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    prefill = fake("p0", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script, fail="after_first", delay=0.05)
    async with router(tokenizer, [prefill, decode]) as client:
        r = await complete(client, max_tokens=8)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_error"
        r = await complete(client, max_tokens=8, stream=True)
        chunks = sse(r.text)
        assert chunks[0]["choices"][0]["text"] == "Hello" and "error" in chunks[-1]


async def test_pd_layout_mismatch_pair_is_never_chosen(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    mismatched = fake("p0", pb.PREFILL, script)
    matched = fake("p1", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script)
    layouts = {"p0": OTHER_LAYOUT}
    async with router(
        tokenizer, [mismatched, matched, decode], layouts, prefill_policy="round_robin"
    ) as client:
        for _ in range(4):
            assert (await complete(client, max_tokens=2)).status_code == 200
    assert mismatched.requests == [] and len(matched.requests) == 4


async def test_pd_only_mismatched_pairs_is_unavailable(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    workers = [fake("p0", pb.PREFILL, script), fake("d0", pb.DECODE, script)]
    async with router(tokenizer, workers, {"p0": OTHER_LAYOUT}) as client:
        assert (await client.get("/health")).status_code == 503
        assert (await complete(client)).status_code == 503


# -- policies over real workers -------------------------------------------------------


async def test_round_robin_spreads_over_two_workers(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    workers = [fake("w0", pb.BOTH, script), fake("w1", pb.BOTH, script)]
    async with router(tokenizer, workers, policy="round_robin") as client:
        for _ in range(6):
            assert (await complete(client, max_tokens=2)).status_code == 200
    assert [len(w.requests) for w in workers] == [3, 3]


async def test_cache_aware_keeps_a_conversation_on_one_worker(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    workers = [fake(f"w{i}", pb.BOTH, script) for i in range(3)]
    system = "You are a helpful assistant who answers briefly. " * 4
    async with router(tokenizer, workers, policy="cache_aware") as client:
        for question in ("What is 2+2?", "Name a color.", "Say hi.", "Count to 3."):
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                },
            )
            assert r.status_code == 200
    assert sorted(len(w.requests) for w in workers) == [0, 0, 4]


# -- disconnects over real HTTP -------------------------------------------------------


@asynccontextmanager
async def http_router(app: Any) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def test_client_disconnect_aborts_the_workers(
    tokenizer: Tokenizer, script: list[int]
) -> None:
    prefill = fake("p0", pb.PREFILL, script)
    decode = fake("d0", pb.DECODE, script, delay=0.1)
    slow = fake("b0", pb.BOTH, script, first_delay=10.0)
    for w in (prefill, decode, slow):
        await w.start()
    pd_app = create_app(
        RouterConfig(), [prefill.info(LAYOUT), decode.info(LAYOUT)], tokenizer=tokenizer
    )
    both_app = create_app(RouterConfig(), [slow.info()], tokenizer=tokenizer)
    try:
        async with http_router(pd_app) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the first token arrived; now hang up
            await eventually(lambda: len(decode.requests) == 1)
            rid = decode.requests[0].request_id
            await eventually(lambda: rid in decode.aborted and rid in prefill.aborted)
            await eventually(lambda: rid in decode.unfinished)
        async with http_router(both_app) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
            await eventually(lambda: slow.aborted == [slow.requests[0].request_id])
    finally:
        for w in (prefill, decode, slow):
            await w.stop()


async def test_streaming_timeout_over_http(tokenizer: Tokenizer, script: list[int]) -> None:
    stalling = fake("b0", pb.BOTH, script, delay=10.0)  # first token at once, then nothing
    await stalling.start()
    app = create_app(RouterConfig(request_timeout=1.0), [stalling.info()], tokenizer=tokenizer)
    try:
        async with http_router(app) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
            r = await client.post("/v1/completions", json=body, timeout=5.0)
            chunks = sse(r.text)
            assert chunks[0]["choices"][0]["text"] == "Hello"
            assert chunks[-1]["error"]["code"] == "timeout"
            assert r.text.rstrip().endswith("data: [DONE]")
            await eventually(lambda: stalling.aborted == [stalling.requests[0].request_id])
    finally:
        await stalling.stop()


# -- discovery through a registry -----------------------------------------------------


@pytest.fixture(params=["bootstrap", "etcd"])
async def registry_url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The same discovery tests over each store: baton's bootstrap, and a real etcd."""
    if request.param == "etcd":
        yield request.getfixturevalue("etcd").url()
        return
    bootstrap, port = await serve_bootstrap(
        "127.0.0.1", 0, lease_ttl=3.0, cluster_token=REGISTRY_TOKEN
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await bootstrap.stop()


REGISTRY_TOKEN = "cluster-secret"


async def test_workers_come_and_go_through_the_registry(
    tokenizer: Tokenizer, script: list[int], registry_url: str
) -> None:
    token = REGISTRY_TOKEN
    w0, w1 = fake("w0", pb.BOTH, script), fake("w1", pb.BOTH, script)
    registrations = []
    try:
        config = RouterConfig(
            registry=RegistryConfig(registry_url), cluster_token=token, policy="round_robin"
        )
        app = create_app(config, tokenizer=tokenizer)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://r"
            ) as client,
        ):
            assert (await client.get("/health")).status_code == 503
            for w in (w0, w1):
                await w.start(cluster_token=token)
                registry = open_registry(RegistryConfig(registry_url), token, lease_ttl=3.0)
                registration = WorkerRegistration(registry, w.info(), 0.2)
                await registration.start()
                registrations.append(registration)

            async def healthy_with(n: int) -> None:
                for _ in range(300):
                    health = (await client.get("/health")).json()
                    if health["workers"]["both"] == n:
                        assert health["registry"]["state"] == "connected"
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"router never saw {n} workers")

            await healthy_with(2)
            for _ in range(4):
                assert (await complete(client, max_tokens=2)).status_code == 200
            assert len(w0.requests) == len(w1.requests) == 2  # calls carried the token
            await registrations[0].stop()  # w0 leaves
            await healthy_with(1)
            assert app.state.pool.channel_addresses() == {w1.address}  # w0's channel closed
            for _ in range(3):
                assert (await complete(client, max_tokens=2)).status_code == 200
            assert len(w0.requests) == 2 and len(w1.requests) == 5
            metrics = (await client.get("/metrics")).text
            assert "baton_router_registry_connected 1.0" in metrics
    finally:
        for registration in registrations:
            await registration.stop()
            await registration.registry.close()
        for w in (w0, w1):
            await w.stop()


# -- the command line -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_baton_router_command_serves_and_stops_on_sigterm() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "baton.services.cli", "router", "--help"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    for group in ("network", "model", "routing", "limits", "security"):
        assert f"{group}:" in help_text
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "baton.services.cli", "router", "--port", str(port),
         "--registry", f"127.0.0.1:{free_port()}", "--log-level", "warning"],
        env={**os.environ, "BATON_API_KEY": "sk-env"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(1200):  # up to 60 s: a loaded machine imports slowly
                try:
                    r = await client.get("/health")
                    break
                except httpx.ConnectError:
                    assert process.poll() is None, process.stderr and process.stderr.read()
                    await asyncio.sleep(0.05)
            assert r.status_code == 503  # no workers registered with that bootstrap
            r = await client.get("/v1/models")
            assert r.status_code == 401  # the key came from BATON_API_KEY
            r = await client.get("/v1/models", headers={"Authorization": "Bearer sk-env"})
            assert Counter(m["id"] for m in r.json()["data"]) == {MODEL: 1}
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
