"""The router's pre-copy (`services/router/precopy.py`) against fake workers: which tokens
the target is asked to cache, when rounds stop, and that a refusal costs nothing more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.services.router import precopy

PAGE = 16


class FakeCall:
    def __init__(self, finish: str) -> None:
        self.finish = finish
        self.cancelled = False

    def __aiter__(self) -> FakeCall:
        self.left = [pb.GenerateResponse(finish_reason=self.finish)]
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if not self.left:
            raise StopAsyncIteration
        return self.left.pop()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _workers(refuse: bool = False, finish: str = "length") -> tuple[Any, Any, list[Any]]:
    asked: list[Any] = []  # (target's Generate, source's Migrate) in call order

    def generate(request: pb.GenerateRequest, timeout: float) -> FakeCall:
        asked.append(request)
        return FakeCall(finish)

    async def migrate(request: pb.MigrateRequest, timeout: float) -> pb.MigrateResponse:
        asked.append(request)
        if refuse:
            code = grpc.StatusCode.FAILED_PRECONDITION
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        return pb.MigrateResponse()

    info = SimpleNamespace(
        worker_id="d2",
        layout=SimpleNamespace(page_size=PAGE),
        load=SimpleNamespace(prefix_cache=True),
    )
    target = SimpleNamespace(
        info=info, worker_id="d2", stub=SimpleNamespace(Generate=generate), peer=pb.PeerInfo
    )
    source = SimpleNamespace(
        worker_id="d1", stub=SimpleNamespace(Migrate=migrate), peer=pb.PeerInfo
    )
    return source, target, asked


def test_short_contexts_and_targets_without_a_cache_move_without_a_precopy() -> None:
    source, target, asked = _workers()
    assert asyncio.run(precopy.warm(source, target, "r", list(range(precopy.MIN_TOKENS)))) == 0
    target.info.load.prefix_cache = False
    assert asyncio.run(precopy.warm(source, target, "r", list(range(4000)))) == 0
    assert asked == []


def test_rounds_chase_the_context_until_few_pages_are_new() -> None:
    source, target, asked = _workers()
    contexts = iter([2000, 2100, 2100, 2110])  # a round's context, then the next check's
    held = asyncio.run(
        precopy.warm_rounds(source, target, "r", lambda: list(range(next(contexts))))
    )
    warming = [a for a in asked if isinstance(a, pb.GenerateRequest)]
    migrates = [a for a in asked if isinstance(a, pb.MigrateRequest)]
    # whole pages but the last token: 1984, then 7 pages more (2096), then none new: done
    assert [len(w.input_ids) for w in warming] == [1984, 2096]
    assert [m.precopy_tokens for m in migrates] == [1984, 2096]
    assert all(w.sampling.max_new_tokens == 1 and w.room for w in warming)
    assert [w.room for w in warming] == [m.room for m in migrates]
    assert held == 2096 // PAGE


def test_a_refused_or_failed_precopy_holds_nothing_and_ends_the_targets_request() -> None:
    for refuse, finish in ((True, "length"), (False, "error")):
        source, target, asked = _workers(refuse, finish)
        held = asyncio.run(precopy.warm_rounds(source, target, "r", lambda: list(range(3000))))
        assert held == 0 and len(asked) == 2  # one round, no second
