"""A live migration's hand-off, the router's side: which moves can be live, and asking the
source to hand a request off once its pages are copied ahead (`precopy.py`).

`migration.py` says what a move is. Once the moves are planned, `connect_ahead` has each
source open its KV data connections to its live targets (`Worker.Connect`, once per pair,
all pairs at once), so that no hand-off waits for a handshake (the first room between two
workers would otherwise open them: for ipc, map the target's pool). A generation carries
its move (`PendingMove`) from `Generation.move_to` until its next attempt started on the
target. A live move gets a room; `ask_live` warms the target's prefix cache, then sends
the source `Migrate`: the source stops the request at its next token and sends its pages
in that room, and the next attempt continues on the target from them. A source that
refuses is reported back (`refused`), and the move goes on by recompute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.services.router import precopy
from baton.services.router.migration import Move
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import WorkerPool

log = logging.getLogger(__name__)

MIGRATE_TIMEOUT_S = 2.0  # the Migrate call that asks for the hand-off
CONNECT_TIMEOUT_S = 5.0  # the Connect call: the moves wait for it (the streams decode on)


@dataclass
class PendingMove:
    """A move asked for and not yet started on its target."""

    target: WorkerHandle
    reason: str
    source: str  # worker id ('' between attempts)
    done: asyncio.Future[Move | None]
    room: int = 0  # live: the room the source sends the pages in (0: recompute)
    handed_off: bool = False  # live: the source stopped the request, its pages wait
    warmed: int = 0  # live: pages of the context copied to the target's cache ahead


def live_capable(pool: WorkerPool, source: WorkerHandle, target: WorkerHandle) -> bool:
    """Whether `source` can hand a request to `target` with its pages (live migration):
    decode workers both, of one KV layout, the source without tensor parallelism (its
    pages would have to be gathered from its ranks first)."""
    return (
        source.role == pb.DECODE
        and target.role == pb.DECODE
        and source.info.layout.tp_size <= 1
        and pool.compatible(source, target)
    )


async def connect_ahead(
    pool: WorkerPool, pairs: Iterable[tuple[WorkerHandle | None, WorkerHandle]]
) -> None:
    """Have each source open its KV data connections to each of its targets of (source,
    target) `pairs` that move live, once per pair, before any hand-off is asked for. A
    source that cannot (a timeout, a worker without Connect) is logged: its first hand-off
    to that target connects, as it would have anyway."""
    live = {
        (source.worker_id, target.worker_id): (source, target)
        for source, target in pairs
        if source is not None and live_capable(pool, source, target)
    }
    await asyncio.gather(*(_connect(source, target) for source, target in live.values()))


async def _connect(source: WorkerHandle, target: WorkerHandle) -> None:
    request = pb.ConnectRequest(peer=target.peer())
    started = time.monotonic()
    try:
        await source.stub.Connect(request, timeout=CONNECT_TIMEOUT_S)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
        details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
        log.info("%s did not connect to %s ahead: %s", source.worker_id, target.worker_id, details)
    else:
        took = (time.monotonic() - started) * 1000
        log.info("%s connected to %s ahead (%.1f ms)", source.worker_id, target.worker_id, took)


def ask_live(
    source: WorkerHandle,
    request_id: str,
    move: PendingMove,
    context: Callable[[], Sequence[int]],
    refused: Callable[[int, str, bool], None],
) -> Coroutine[Any, Any, None]:
    """The work, to run in the background: copy the pages of `context()` (it grows) to the
    move's target ahead (`precopy.py`), then ask `source` to hand `request_id` off to it in
    the move's room; `refused(room, why, ended)` when it would not or could not be asked
    (`ended`: the request is no longer streaming there: its last outputs are on their way)."""
    room, target = move.room, move.target

    async def ask() -> None:
        move.warmed = await precopy.warm_rounds(source, target, request_id, context)
        if move.room != room or move.done.done():
            return  # refused, ended or moved otherwise meanwhile
        request = pb.MigrateRequest(request_id=request_id, room=room, peer=target.peer())
        try:
            await source.stub.Migrate(request, timeout=MIGRATE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            rpc = isinstance(e, grpc.aio.AioRpcError)
            details = e.details() if rpc else str(e)
            ended = rpc and e.code() == grpc.StatusCode.NOT_FOUND
            refused(room, f"{source.worker_id}: {details}", ended)

    return ask()
