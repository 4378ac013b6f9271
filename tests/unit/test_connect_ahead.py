"""Opening a live migration's KV data connections ahead of its hand-off (issue 41): the
router asks each source once per live target when the moves are planned
(`handoff.connect_ahead`), and the source's scheduler answers once its connections are open
(`answer_connects`), so that no stream's cutover waits for a handshake."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import grpc
import grpc.aio
import msgspec

from baton.common.protocol import ConnectOut, decode_from_scheduler
from baton.common.rpc import baton_pb2 as pb
from baton.services.router.handoff import connect_ahead
from baton.services.router.worker_handle import WorkerHandle
from baton.services.worker.scheduler_proc import answer_connects


class Stub:
    def __init__(self, fail: bool = False) -> None:
        self.connected: list[str] = []  # target worker ids
        self.fail = fail

    async def Connect(self, request: pb.ConnectRequest, timeout: float) -> pb.ConnectResponse:
        assert timeout > 0
        await asyncio.sleep(0.05)
        self.connected.append(request.peer.worker_id)
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "old"
            )
        return pb.ConnectResponse()


def worker(worker_id: str, role: int = pb.DECODE, fail: bool = False) -> WorkerHandle:
    info = pb.WorkerInfo(worker_id=worker_id, role=role, transfer_address=f"{worker_id}:1")
    return WorkerHandle(info, stub=Stub(fail))  # type: ignore[arg-type]


class Pool:
    def compatible(self, source: WorkerHandle, target: WorkerHandle) -> bool:
        return True


def test_each_source_connects_once_to_each_live_target_and_all_at_once() -> None:
    d0, d1, d2, both = worker("d0"), worker("d1"), worker("d2"), worker("a0", pb.BOTH)
    pairs: list[tuple[WorkerHandle | None, WorkerHandle]] = [
        (d0, d1), (d0, d2), (d0, d1), (d0, d1), (d0, d2),  # 5 streams of d0
        (d1, d2),
        (d0, both),  # recompute: no KV travels
        (None, d1),  # between attempts: placed anew
    ]  # fmt: skip

    async def run() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await connect_ahead(Pool(), pairs)  # type: ignore[arg-type]
        return loop.time() - started

    took = asyncio.run(run())
    assert sorted(d0.stub.connected) == ["d1", "d2"]  # type: ignore[attr-defined]
    assert d1.stub.connected == ["d2"]  # type: ignore[attr-defined]
    assert both.stub.connected == []  # type: ignore[attr-defined]
    assert took < 0.14  # three 50 ms connects, at once


def test_a_source_that_cannot_connect_ahead_moves_anyway() -> None:
    old, target = worker("d0", fail=True), worker("d1")
    asyncio.run(connect_ahead(Pool(), [(old, target)]))  # type: ignore[arg-type]
    assert old.stub.connected == ["d1"]  # type: ignore[attr-defined]


class Socket:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, data: bytes) -> None:
        self.sent.append(decode_from_scheduler(data))


def test_the_scheduler_answers_once_the_connections_are_open() -> None:
    opening, stuck, failing, done = Future[None](), Future[None](), Future[None](), Future[None]()
    done.set_result(None)
    failing.set_exception(ConnectionRefusedError("refused"))
    send = Socket()
    pending = [
        ("a:1", opening, 10.0), ("b:1", failing, 10.0), ("c:1", done, 10.0),
        ("d:1", None, 10.0), ("e:1", stuck, 2.0),
    ]  # fmt: skip
    left = answer_connects(pending, send, now=1.0)  # type: ignore[arg-type]
    assert left == [("a:1", opening, 10.0), ("e:1", stuck, 2.0)]
    assert send.sent == [
        ConnectOut("b:1", "refused"),
        ConnectOut("c:1"),
        ConnectOut("d:1", "this worker hands no request off"),
    ]
    opening.set_result(None)
    assert answer_connects(left, send, now=3.0) == []  # type: ignore[arg-type]
    # the stuck one past its deadline: answered, so that the loop stops polling for it
    assert send.sent[-2:] == [ConnectOut("a:1"), ConnectOut("e:1", "still connecting")]
    assert msgspec.msgpack.encode(send.sent[-1])  # (it crosses the process boundary)
