"""The router when workers fail under a live request (fake workers, in-process): every end
of a worker stream reaches the client at once, and a stream whose worker is lost continues
on another worker where it stood."""

from __future__ import annotations

import asyncio
import gc
import time

import grpc
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc import baton_pb2_grpc as pb_grpc
from baton.common.rpc.auth import make_channel
from baton.common.tokenizer import Tokenizer
from baton.services.router.attempt import Attempt, Timings, WorkerFailure
from baton.services.router.worker_handle import WorkerHandle
from tests.integration.router_api import eventually
from tests.integration.test_router_cluster import LAYOUT, complete, fake, router, sse

pytestmark = pytest.mark.timeout(30)

SCRIPT = list(range(40, 72))  # 32 distinct tokens: a resumed stream shows where it resumed


async def test_a_closed_channel_fails_the_stream_at_once() -> None:
    # grpc.aio cancels the calls of a channel closed under them; the stream must fail,
    # not end silently (the client's tokens would stop with no error and no [DONE]).
    worker = fake("w0", pb.BOTH, SCRIPT, delay=0.05)
    await worker.start()
    channel = make_channel(worker.address, None)
    handle = WorkerHandle(worker.info(), pb_grpc.WorkerStub(channel))
    attempt = Attempt("r1", lambda w, rid: None)
    request = pb.GenerateRequest(
        request_id="r1", input_ids=[1], sampling=pb.SamplingParams(max_new_tokens=30)
    )
    try:
        attempt.start(handle, request)
        await attempt.next(Timings())  # the first token
        started = time.monotonic()
        await channel.close()
        with pytest.raises(WorkerFailure):
            while True:
                await asyncio.wait_for(attempt.next(Timings()), 5)
        assert time.monotonic() - started < 2
    finally:
        attempt.close()
        await worker.stop()


async def test_aggregated_stream_migrates_and_continues_where_it_stood(
    tokenizer: Tokenizer,
) -> None:
    dying = fake("w0", pb.BOTH, SCRIPT, fail="after_first", fail_after=4, delay=0.01)
    healthy = fake("w1", pb.BOTH, SCRIPT)
    async with router(tokenizer, [dying, healthy], policy="round_robin") as client:
        r = await complete(client, max_tokens=12, stream=True, temperature=0.7)
        chunks = sse(r.text)
        assert "error" not in chunks[-1], r.text
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(SCRIPT[:12])
        metrics = (await client.get("/metrics")).text
    (first,), (resumed,) = dying.requests, healthy.requests
    assert list(resumed.input_ids) == [*first.input_ids, *SCRIPT[:4]]
    assert resumed.sampling.output_offset == 4 and resumed.sampling.max_new_tokens == 8
    # A sampled request without a seed got one from the router, the same on both runs.
    assert first.sampling.HasField("seed") and resumed.sampling.seed == first.sampling.seed
    assert 'baton_router_reruns_total{kind="migration"} 1.0' in metrics


async def test_pd_decode_lost_mid_stream_continues_on_another_pair(
    tokenizer: Tokenizer,
) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    dying = fake("d0", pb.DECODE, SCRIPT, fail="after_first", fail_after=3, delay=0.01)
    healthy = fake("d1", pb.DECODE, SCRIPT)
    async with router(tokenizer, [prefill, dying, healthy], decode_policy="round_robin") as client:
        r = await complete(client, max_tokens=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:10])
        assert r.json()["usage"]["completion_tokens"] == 10
    # P's first token and 3 of d0's passed on: the rerun resumes after 4 tokens.
    assert [len(r.input_ids) for r in prefill.requests][1] == len(prefill.requests[0].input_ids) + 4
    assert healthy.requests[0].sampling.output_offset == 4


async def test_a_worker_that_leaves_fails_its_streams_at_once(tokenizer: Tokenizer) -> None:
    # A stopped worker (SIGSTOP) sends nothing and no error: when its lease lapses and the
    # router drops it, its streams move on without waiting for the channel.
    silent = fake("w0", pb.BOTH, SCRIPT, fail="hang", fail_after=2)
    healthy = fake("w1", pb.BOTH, SCRIPT)
    async with router(tokenizer, [silent, healthy], policy="round_robin") as client:
        pool = client._transport.app.state.pool  # type: ignore[attr-defined]
        task = asyncio.create_task(complete(client, max_tokens=6))
        await eventually(lambda: len(silent.requests) == 1)
        await asyncio.sleep(0.2)
        pool.remove("w0")
        r = await asyncio.wait_for(task, 5)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:6])
        await eventually(lambda: silent.requests[0].request_id in silent.unfinished)


async def test_a_live_worker_whose_lease_lapsed_finishes_its_streams(tokenizer: Tokenizer) -> None:
    # Its heartbeats missed the lease (a starved host, a registry outage) while it decoded
    # on: out of every choice and of /health's counts, its stream goes on, and once it
    # registers again it serves as before. Nothing moved, nothing recomputed.
    slow = fake("w0", pb.BOTH, SCRIPT, delay=0.05)
    other = fake("w1", pb.BOTH, SCRIPT)
    async with router(tokenizer, [slow, other], policy="round_robin") as client:
        pool = client._transport.app.state.pool  # type: ignore[attr-defined]
        task = asyncio.create_task(complete(client, max_tokens=12))
        await eventually(lambda: len(slow.requests) == 1)
        registered = pool.get("w0").info
        pool.apply(pb.MembershipEvent(type=pb.MembershipEvent.REMOVED, worker=registered))
        health = (await client.get("/health")).json()
        assert health["lapsed"] == ["w0"] and health["worker_ids"] == ["w1"]
        await asyncio.sleep(0.2)
        pool.upsert(registered)
        r = await asyncio.wait_for(task, 5)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:12])
        assert len(slow.requests) == 1 and other.requests == []
        assert "lapsed" not in (await client.get("/health")).json()


async def test_reruns_are_bounded(tokenizer: Tokenizer) -> None:
    workers = [fake(f"w{i}", pb.BOTH, SCRIPT, fail="after_first", fail_after=1) for i in range(4)]
    async with router(tokenizer, workers, policy="round_robin") as client:
        r = await complete(client, max_tokens=10, stream=True)
        chunks = sse(r.text)
        assert chunks[-1]["error"]["code"] == "worker_error"
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == tokenizer.decode(SCRIPT[:3])
    assert [len(w.requests) for w in workers] == [1, 1, 1, 0]


async def test_greedy_request_without_seed_is_sent_without_one(tokenizer: Tokenizer) -> None:
    worker = fake("w0", pb.BOTH, SCRIPT)
    async with router(tokenizer, [worker]) as client:
        assert (await complete(client, max_tokens=2, temperature=0)).status_code == 200
    assert not worker.requests[0].sampling.HasField("seed")


# -- a worker whose address refuses connections (issue #42 item 9) ----------------------


async def test_a_dead_decode_is_suspended_and_another_serves(tokenizer: Tokenizer) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    dead = fake("d0", pb.DECODE, SCRIPT)
    healthy = fake("d1", pb.DECODE, SCRIPT)
    async with router(tokenizer, [prefill, dead, healthy], decode_policy="round_robin") as client:
        await dead.stop()  # SIGKILLed: its address refuses connections; its lease runs on
        for _ in range(3):
            r = await complete(client, max_tokens=6)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(SCRIPT[:6])
        health = (await client.get("/health")).json()
        metrics = (await client.get("/metrics")).text
    assert health["worker_ids"] == ["d1", "p0"] and health["workers"]["decode"] == 1
    assert dead.requests == [] and len(healthy.requests) == 3  # d0 was tried once
    assert "baton_router_worker_suspensions_total 1.0" in metrics


async def test_a_worker_that_fails_a_call_itself_is_not_suspended(tokenizer: Tokenizer) -> None:
    # A draining worker answers UNAVAILABLE too; its address does not refuse.
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    draining = fake("d0", pb.DECODE, SCRIPT, fail="at_start")
    healthy = fake("d1", pb.DECODE, SCRIPT)
    workers = [prefill, draining, healthy]
    async with router(tokenizer, workers, decode_policy="round_robin") as client:
        assert (await complete(client, max_tokens=4)).status_code == 200
        health = (await client.get("/health")).json()
    assert len(draining.requests) == 1
    assert health["worker_ids"] == ["d0", "d1", "p0"]


async def test_requests_wait_for_the_only_decode_restarted_on_its_port(
    tokenizer: Tokenizer,
) -> None:
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    dead = fake("d0", pb.DECODE, SCRIPT, delay=0.02)
    async with router(tokenizer, [prefill, dead]) as client:
        pool = client._transport.app.state.pool  # type: ignore[attr-defined]
        stream = asyncio.create_task(complete(client, max_tokens=20, stream=True))
        await eventually(lambda: len(dead.requests) == 1)
        await asyncio.sleep(0.1)  # mid-stream
        await dead.stop()
        # The stream's rerun finds the address refusing: d0 leaves /health at once.
        await eventually(lambda: pool.worker_ids() == ["p0"], timeout=2)
        assert (await client.get("/health")).status_code == 503
        after = asyncio.create_task(complete(client, max_tokens=6))  # waits, not 503
        await asyncio.sleep(0.5)
        assert not stream.done() and not after.done()
        restarted = fake("d0", pb.DECODE, SCRIPT)
        port = int(dead.address.rsplit(":", 1)[1])
        await restarted.start(port=port)
        try:
            info = restarted.info(LAYOUT)
            info.incarnation = "second"
            pool.upsert(info)
            r = await asyncio.wait_for(stream, 5)
            chunks = sse(r.text)
            assert "error" not in chunks[-1], r.text
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert text == tokenizer.decode(SCRIPT[:20])
            r = await asyncio.wait_for(after, 5)
            assert r.status_code == 200, r.text
            metrics = (await client.get("/metrics")).text
        finally:
            await restarted.stop()
    assert len(restarted.requests) == 2  # the resumed stream and the request after
    assert 'baton_router_waits_for_worker_total{outcome="served"}' in metrics


async def test_finished_requests_leave_no_cyclic_garbage_behind(tokenizer: Tokenizer) -> None:
    # A finished stream's read was cancelled: grpc's call, its CANCELLED status and the
    # tracebacks then formed cycles (~50 objects a call) that only a full collection freed,
    # and a router serving thousands of requests stalled every stream for 0.3-0.75 s in one.
    prefill = fake("p0", pb.PREFILL, SCRIPT)
    decode = fake("d0", pb.DECODE, SCRIPT)
    async with router(tokenizer, [prefill, decode]) as client:
        await complete(client, max_tokens=4)  # the first request's one-off objects
        gc.collect()
        for _ in range(20):
            assert (await complete(client, max_tokens=4)).status_code == 200
        await asyncio.sleep(0.2)  # the streams end after their finish
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            calls = [o for o in gc.garbage if isinstance(o, grpc.aio.Call)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert calls == []
