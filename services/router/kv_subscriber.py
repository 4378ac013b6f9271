"""Following the workers' KV events: one `SubscribeKVEvents` stream per worker, into the
router's `KVIndex`.

A stream starts where the index stands (`KVIndex.resume_from`: the batch after the last
applied, or a snapshot), and starts again, asking for a snapshot, whenever the index loses
sync. A stream that fails is opened again after a backoff; meanwhile the index does not
count that worker as fresh, and routing guesses for it. A worker that publishes no events
(`--kv-events off`, or an older worker) is left to the guess. Joins and departures come
from the pool: a worker that leaves is forgotten.
"""

from __future__ import annotations

import asyncio
import logging

import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import kv_batch_from_proto
from baton.services.router.kv_index import KVIndex
from baton.services.router.worker_handle import WorkerHandle
from baton.services.router.workers import ROLE_NAMES, WorkerPool

log = logging.getLogger(__name__)

RETRY_S = 0.5  # first wait before a failed stream is opened again; doubles up to MAX_RETRY_S
MAX_RETRY_S = 5.0
_NO_EVENTS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


class KVSubscriber:
    def __init__(self, pool: WorkerPool, index: KVIndex) -> None:
        self._pool = pool
        self._index = index
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        """Follow every worker in the pool now and as they join (on the serving loop)."""
        self._pool.on_joined(self._follow_new)
        self._pool.on_removed(self._stop)
        self._follow_new()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _follow_new(self) -> None:
        for role, role_name in ROLE_NAMES.items():
            for handle in self._pool.workers(role):
                if handle.worker_id not in self._tasks:
                    self._index.track(handle.worker_id, role_name)
                    task = asyncio.get_running_loop().create_task(self._follow(handle))
                    self._tasks[handle.worker_id] = task

    def _stop(self, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._index.forget(worker_id)

    async def _follow(self, worker: WorkerHandle) -> None:
        worker_id = worker.worker_id
        retry = RETRY_S
        while True:
            incarnation, from_seq = self._index.resume_from(worker_id)
            request = pb.KVEventsRequest(incarnation=incarnation, from_seq=from_seq)
            call = worker.stub.SubscribeKVEvents(request)
            in_sync = True
            try:
                async for message in call:
                    in_sync = self._index.apply(worker_id, kv_batch_from_proto(message))
                    if not in_sync:
                        log.info("KV events of %s out of sync: asking for a snapshot", worker_id)
                        break
                    retry = RETRY_S
            except grpc.aio.AioRpcError as e:
                if e.code() in _NO_EVENTS:
                    self._index.forget(worker_id)
                    log.info(
                        "worker %s publishes no KV events (%s); routing guesses its cache",
                        worker_id,
                        e.details(),
                    )
                    return
                log.debug("KV event stream of %s failed: %s", worker_id, e)
            finally:
                call.cancel()
                self._index.disconnected(worker_id)
            if in_sync:  # the stream failed or ended: wait before opening it again
                await asyncio.sleep(retry)
                retry = min(2 * retry, MAX_RETRY_S)
