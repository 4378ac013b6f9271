"""The router's worker pool when a worker's address refuses connections (issue #42 item 9),
without processes: suspension, the wait for a worker restarted on its port, incarnations,
and the reruns' back-off."""

from __future__ import annotations

import asyncio
import socket

import grpc
import grpc.aio
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.generation import RERUN_BACKOFF_S, rerun_backoff
from baton.services.router.workers import WorkerPool

LAYOUT = pb.KVLayout(model="tiny", page_size=4, dtype="float32", num_layers=2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(worker_id: str, role: int, port: int, incarnation: str = "a") -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address=f"127.0.0.1:{port}",
        layout=LAYOUT,
        incarnation=incarnation,
        capacity=pb.Capacity(max_running_requests=8),
    )


async def pd_pool(clock: Clock, suspension_s: float = 10.0) -> WorkerPool:
    pool = WorkerPool(None, suspension_s=suspension_s, clock=clock)
    pool.upsert(info("p", pb.PREFILL, 1))
    pool.upsert(info("d", pb.DECODE, 2))
    return pool


async def test_a_suspended_worker_leaves_the_choices_and_health_at_once() -> None:
    clock = Clock()
    pool = await pd_pool(clock)
    try:
        (decode,) = pool.workers(pb.DECODE)
        assert pool.suspend(decode)
        assert pool.workers(pb.DECODE) == []
        assert pool.worker_ids() == ["p"]
        assert pool.counts_by_role()["decode"] == 0
        assert not pool.usable()  # /health answers 503: no pair left
        assert pool.expects_return()  # but requests wait for it rather than fail
        assert not pool.suspend(decode)  # counted once
        # Its load still changes in the registry (a heartbeat sent before it died): that
        # is not an answer.
        update = info("d", pb.DECODE, 2)
        update.load.running = 3
        pool.upsert(update)
        assert pool.workers(pb.DECODE) == []
    finally:
        await pool.close()


async def test_a_new_incarnation_on_the_same_port_is_a_new_worker() -> None:
    clock = Clock()
    pool = await pd_pool(clock)
    try:
        (old,) = pool.workers(pb.DECODE)
        pool.suspend(old)
        pool.upsert(info("d", pb.DECODE, 2, incarnation="b"))
        (new,) = pool.workers(pb.DECODE)
        assert new is not old and new.info.incarnation == "b"
        assert new.channel is not old.channel  # nothing reaches it on the old channel
        assert pool.usable() and not pool.expects_return()
        # A late failure of the old incarnation's call suspends nothing.
        assert not pool.suspend(old)
        assert pool.workers(pb.DECODE) == [new]
    finally:
        await pool.close()


async def test_a_worker_still_registered_is_offered_again_after_its_suspension() -> None:
    clock = Clock()
    pool = await pd_pool(clock, suspension_s=10.0)
    try:
        (decode,) = pool.workers(pb.DECODE)
        pool.suspend(decode)
        clock.now += 9.9
        assert pool.workers(pb.DECODE) == []
        clock.now += 0.2  # its heartbeats kept its lease: it lives
        assert pool.workers(pb.DECODE) == [decode]
        assert not pool.expects_return()
    finally:
        await pool.close()


async def test_requests_wait_for_a_suspended_worker_that_left_until_it_returns() -> None:
    pool = WorkerPool(None, suspension_s=5.0)  # the real clock: wait_usable times out
    pool.upsert(info("p", pb.PREFILL, 1))
    pool.upsert(info("d", pb.DECODE, 2))
    try:
        (decode,) = pool.workers(pb.DECODE)
        pool.suspend(decode)
        pool.remove("d")  # its lease lapsed before it came back
        assert pool.expects_return()
        waiting = asyncio.create_task(pool.wait_usable())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        pool.upsert(info("d", pb.DECODE, 2, incarnation="b"))
        assert await asyncio.wait_for(waiting, 1) is True
    finally:
        await pool.close()


async def test_the_wait_ends_with_the_suspension() -> None:
    pool = WorkerPool(None, suspension_s=0.3)
    pool.upsert(info("p", pb.PREFILL, 1))
    pool.upsert(info("d", pb.DECODE, 2))
    try:
        (decode,) = pool.workers(pb.DECODE)
        pool.suspend(decode)
        pool.remove("d")
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(pool.wait_usable(), 2) is False
        assert 0.25 < asyncio.get_running_loop().time() - started < 1.0
        assert not pool.expects_return()
    finally:
        await pool.close()


def test_reruns_back_off_with_jitter() -> None:
    first = [rerun_backoff(0) for _ in range(200)]
    second = [rerun_backoff(1) for _ in range(200)]
    assert all(RERUN_BACKOFF_S / 2 <= s <= RERUN_BACKOFF_S for s in first)
    assert all(2 * RERUN_BACKOFF_S <= s <= 4 * RERUN_BACKOFF_S for s in second)
    assert len(set(first)) > 100  # jittered: one worker's streams do not return together


async def test_a_handle_knows_its_address_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    pool = WorkerPool(None)
    pool.upsert(info("d", pb.DECODE, port))
    (decode,) = pool.workers(pb.DECODE)
    try:
        assert not decode.refused()  # not tried yet
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await decode.stub.Health(pb.HealthRequest(), timeout=2)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert decode.refused()
    finally:
        await pool.close()
