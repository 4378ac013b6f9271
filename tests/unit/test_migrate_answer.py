"""The frontend's end of a Migrate (`SchedulerLink.migrate`) against a stand-in scheduler:
a refusal comes back as soon as the scheduler answers, so that the router falls back at
once instead of waiting out its move timeout (issue 41)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from baton.common.protocol import (
    ConnectOut,
    ConnectReq,
    MigrateOut,
    MigrateReq,
    PeerInfo,
    decode_to_scheduler,
    encode,
)
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.scheduler_link import SchedulerLink

pytestmark = pytest.mark.timeout(30)
TARGET = PeerInfo("d2", "127.0.0.1:5000")


class StandIn:
    """A scheduler connected to the link; `answer` answers one MigrateReq."""

    def __init__(self, link_in: str, link_out: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pull, self.push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.pull.connect(link_in)
        self.push.connect(link_out)

    async def answer(self, refused: str) -> None:
        msg = decode_to_scheduler(await self.pull.recv())
        assert isinstance(msg, MigrateReq)
        await self.push.send(encode(MigrateOut(msg.room, refused)))

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()


async def _connected(link: SchedulerLink) -> None:
    """Until the link's first send would reach a scheduler (ZMQ connects in the background)."""
    while True:
        if await link.push.poll(0, zmq.POLLOUT):
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("refused", ["request r1 is moving already", ""])
def test_the_schedulers_answer_comes_back_at_once(tmp_path: Path, refused: str) -> None:
    to_scheduler = f"ipc://{tmp_path}/to"
    from_scheduler = f"ipc://{tmp_path}/from"

    async def run() -> tuple[MigrateOut, float]:
        link = SchedulerLink(to_scheduler, from_scheduler, WorkerMetrics("decode"))
        scheduler = StandIn(to_scheduler, from_scheduler)
        try:
            await asyncio.wait_for(_connected(link), 5)
            answering = asyncio.create_task(scheduler.answer(refused))
            started = time.monotonic()
            out = await link.migrate(MigrateReq("r1", 7, TARGET), timeout=10)
            took = time.monotonic() - started
            await answering
            return out, took
        finally:
            scheduler.close()
            link.close()

    out, took = asyncio.run(run())
    assert out == MigrateOut(7, refused)
    assert took < 2


def test_a_scheduler_that_does_not_answer_is_a_refusal(tmp_path: Path) -> None:
    async def run() -> MigrateOut:
        link = SchedulerLink(
            f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from", WorkerMetrics("decode")
        )
        silent = StandIn(f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from")  # never answers
        try:
            await asyncio.wait_for(_connected(link), 5)
            return await link.migrate(MigrateReq("r1", 7, TARGET), timeout=0.2)
        finally:
            silent.close()
            link.close()

    out = asyncio.run(run())
    assert out.room == 7 and "did not answer" in out.refused


def test_asks_to_connect_to_one_target_share_the_schedulers_answer(tmp_path: Path) -> None:
    peer = PeerInfo("d2", "127.0.0.1:5000", "127.0.0.1:5001")

    async def run() -> tuple[list[ConnectOut], Any]:
        link = SchedulerLink(
            f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from", WorkerMetrics("decode")
        )
        scheduler = StandIn(f"ipc://{tmp_path}/to", f"ipc://{tmp_path}/from")
        try:
            await asyncio.wait_for(_connected(link), 5)
            asks = [asyncio.create_task(link.connect(ConnectReq(peer), 5)) for _ in range(3)]
            msg = decode_to_scheduler(await scheduler.pull.recv())
            assert isinstance(msg, ConnectReq) and msg.peer == peer
            await scheduler.push.send(encode(ConnectOut(peer.transfer_address)))
            answers = await asyncio.gather(*asks)
            more = await scheduler.pull.poll(100)  # a second ConnectReq, had one been sent
            return answers, more
        finally:
            scheduler.close()
            link.close()

    answers, more = asyncio.run(run())
    assert answers == [ConnectOut("127.0.0.1:5001")] * 3 and not more
