"""The router's dispatcher: the generations running now, and the work they leave behind.

It makes each request's `Generation` (`generation.py`) with the workers' choice
(`pairing.py`), knows the running ones by request id and their attempts (failing those of a
worker that leaves the cluster at once), runs `Abort` calls and live migrations' asks in
the background and waits for them briefly at shutdown, and moves running generations on
request (`migrate`, `migration.py`). A generation reaches the dispatcher only through
`generation.Cluster`: this module imports the generation, never the other way round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.attempt import Attempt, EngineRequest
from baton.services.router.generation import Generation
from baton.services.router.handoff import connect_ahead
from baton.services.router.migration import (
    MigrationReport,
    UnknownWorker,
    check_request,
    check_target,
    plan_moves,
    wait_moves,
)
from baton.services.router.pairing import WorkerChoice
from baton.services.router.worker_handle import WorkerHandle

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0


class Dispatcher:
    def __init__(self, choice: WorkerChoice) -> None:
        self.choice = choice
        self.pool = choice.pool
        self.metrics = choice.metrics
        self._aborts: set[asyncio.Task[None]] = set()
        self._attempts: set[Attempt] = set()  # running, to fail when one of their workers leaves
        self._generations: dict[str, Generation] = {}  # running, by request id
        self.pool.on_removed(self._worker_left)

    def available(self) -> bool:
        """Whether a request can be served: by a worker now, or by one expected back."""
        return self.pool.usable() or self.pool.expects_return()

    def generation(self, request: EngineRequest) -> Generation:
        return Generation(self, self.choice, request)

    async def close(self) -> None:
        """Wait (briefly) for Abort calls still in flight."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def track(self, attempt: Attempt) -> None:
        self._attempts.add(attempt)

    def untrack(self, attempt: Attempt) -> None:
        self._attempts.discard(attempt)

    def running(self, generation: Generation) -> None:
        self._generations[generation.request.request_id] = generation

    def ended(self, generation: Generation) -> None:
        request_id = generation.request.request_id
        if self._generations.get(request_id) is generation:
            del self._generations[request_id]

    async def migrate(
        self,
        request_ids: list[str] | None = None,
        worker_id: str | None = None,
        to: str | None = None,
        *,
        reason: str = "admin",
    ) -> MigrationReport:
        """Move the named running generations, or every one whose decoding worker is
        `worker_id`, to `to` or the policy's choice (never their own worker), without a
        gap, repeat or loss in their streams (`migration.py`). Returns once each move took
        effect. ValueError: bad arguments; UnknownWorker: `worker_id` or `to` unknown;
        NoTarget: a generation has nowhere to go (nothing is moved then)."""
        check_request(request_ids, worker_id)
        if worker_id is not None and self.pool.get(worker_id) is None:
            raise UnknownWorker(f"no worker {worker_id!r}")
        target = check_target(self.pool, to) if to is not None else None
        if request_ids is not None:
            wanted = list(dict.fromkeys(request_ids))
            chosen = [self._generations[r] for r in wanted if r in self._generations]
            not_running = [r for r in wanted if r not in self._generations]
        else:
            chosen = [g for g in self._generations.values() if g.worker_id == worker_id]
            not_running = []
        log.info(
            "migrate %s: %d of %d running generations (to %s, %s)",
            request_ids if request_ids is not None else f"worker {worker_id}",
            len(chosen),
            len(self._generations),
            to or "the policy's choice",
            reason,
        )
        plans, stay = plan_moves(self.pool, chosen, target, self.choice.choose_target)
        if stay:
            log.info(
                "migrate: %d generations stay where they are: no target has a running slot "
                "and KV pages free for them",
                len(stay),
            )
        await connect_ahead(self.pool, [(g.worker, t) for g, t in plans])
        moves, ended = {}, []  # (ended: while the connections opened)
        for g, t in plans:
            if g.request_id in self._generations and self._generations[g.request_id] is g:
                moves[g.request_id] = g.move_to(t, reason)
            else:
                ended.append(g.request_id)
        moved, finished = await wait_moves(moves)
        finished += ended
        for move in moved:
            log.info(
                "request %s moved %s -> %s (%s, %s) after %d tokens",
                move.request_id,
                move.source or "-",
                move.target,
                move.kind,
                reason,
                move.tokens,
            )
        return MigrationReport(moved, finished, not_running, [g.request_id for g in stay])

    def _worker_left(self, worker_id: str) -> None:
        for attempt in list(self._attempts):
            attempt.worker_left(worker_id)

    def abort_later(self, worker: WorkerHandle, request_id: str) -> None:
        self.background(self._abort(worker, request_id))

    async def _abort(self, worker: WorkerHandle, request_id: str) -> None:
        try:
            await worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.debug("abort %s on %s: %s", request_id, worker.worker_id, e)
