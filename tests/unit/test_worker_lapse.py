"""A worker the registry drops while requests run on it (its lease lapsed): its streams go
on while it answers, it serves again when it registers again, and it is removed when it
stops answering or nothing runs on it any more. Without processes: the worker's `Health`
is a fake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.services.router import workers as workers_module
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import WorkerPool
from tests.unit.test_worker_pool import info


def removed(worker: pb.WorkerInfo) -> pb.MembershipEvent:
    return pb.MembershipEvent(type=pb.MembershipEvent.REMOVED, worker=worker)


class Health:
    """A worker's Health: answers, or fails as a stopped worker's call does."""

    def __init__(self) -> None:
        self.answers = True
        self.asked = 0

    async def Health(self, request: pb.HealthRequest, timeout: float) -> pb.HealthResponse:
        self.asked += 1
        if not self.answers:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return pb.HealthResponse(ok=True, role="decode", status="serving")


@pytest.fixture(autouse=True)
def fast_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_module, "PROBE_INTERVAL_S", 0.01)


async def busy_decode(pool: WorkerPool, left: list[str]) -> tuple[WorkerHandle, Health]:
    """A P/D pool whose decode worker runs a request and answers `Health` (the fake)."""
    pool.on_removed(left.append)
    pool.upsert(info("p", pb.PREFILL, 1))
    pool.upsert(info("d", pb.DECODE, 2))
    (decode,) = pool.workers(pb.DECODE)
    decode.in_flight = 1
    health = decode.stub = Health()  # type: ignore[assignment]
    return decode, health


async def until(predicate: object, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(None)
    yield pool
    await pool.close()


async def test_a_live_worker_whose_lease_lapsed_keeps_its_streams_and_serves_again(
    pool: WorkerPool,
) -> None:
    left: list[str] = []
    decode, health = await busy_decode(pool, left)
    channel = decode.channel
    pool.apply(removed(decode.info))
    # Out of every choice and count at once, listed as lapsed.
    assert pool.workers(pb.DECODE) == [] and pool.counts_by_role()["decode"] == 0
    assert pool.lapsed() == ["d"] and not pool.usable()
    await until(lambda: health.asked >= 3)
    assert left == []  # its running request never failed over
    # It registers again (the same process): it serves, on the same channel.
    pool.upsert(info("d", pb.DECODE, 2))
    assert pool.workers(pb.DECODE) == [decode] and decode.channel is channel
    assert pool.lapsed() == [] and left == []
    assert channel is not None and pool.channel_addresses() == {"127.0.0.1:1", "127.0.0.1:2"}
    asked = health.asked
    await asyncio.sleep(0.05)
    assert health.asked == asked  # no more probes


async def test_a_lapsed_worker_that_does_not_answer_is_removed(pool: WorkerPool) -> None:
    left: list[str] = []
    decode, health = await busy_decode(pool, left)
    health.answers = False  # stopped (SIGSTOP), or its host gone
    pool.apply(removed(decode.info))
    await until(lambda: left == ["d"])
    assert pool.lapsed() == [] and pool.get("d") is None
    assert pool.channel_addresses() == {"127.0.0.1:1"}


async def test_a_lapsed_worker_is_removed_once_nothing_runs_on_it(pool: WorkerPool) -> None:
    left: list[str] = []
    decode, health = await busy_decode(pool, left)
    pool.apply(removed(decode.info))
    await until(lambda: health.asked >= 1)
    decode.in_flight = 0  # its last stream ended
    await until(lambda: left == ["d"])
    assert pool.lapsed() == []


async def test_an_idle_worker_the_registry_drops_is_removed_at_once(pool: WorkerPool) -> None:
    left: list[str] = []
    decode, health = await busy_decode(pool, left)
    decode.in_flight = 0
    pool.apply(removed(decode.info))
    assert left == ["d"] and pool.lapsed() == [] and health.asked == 0


async def test_a_new_incarnation_replaces_a_lapsed_worker_and_its_streams_fail_over(
    pool: WorkerPool,
) -> None:
    left: list[str] = []
    decode, _ = await busy_decode(pool, left)
    pool.apply(removed(decode.info))
    pool.upsert(info("d", pb.DECODE, 2, incarnation="b"))  # restarted: a new process
    assert left == ["d"] and pool.lapsed() == []
    (new,) = pool.workers(pb.DECODE)
    assert new is not decode and new.channel is not decode.channel
