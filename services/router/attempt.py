"""One attempt at a generation: the worker streams it opened, and the cleanup it owes.

Every way a worker stream can end without finishing the request reaches the attempt's
reader at once as a `WorkerFailure`: a gRPC error, a closed channel (grpc.aio cancels the
call: `asyncio.CancelledError` inside the stream, not a cancelled task), the worker
leaving the cluster (`worker_left`), or a response that reports an error or abort. A planned migration (`move`) reaches it
the same way, as `Moved`, after the outputs that arrived before it.
Each response is read as the worker's own `TokenOut` (`response_from_proto`) the moment
it arrives, and each request is sent as the proto of an `EngineRequest` (`grpc_request`):
nothing past the attempt sees protobuf.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import grpc.aio

from baton.common.protocol import TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import request_to_proto, response_from_proto
from baton.common.sampling import SamplingParams
from baton.services.router import tracing
from baton.services.router.worker_handle import WorkerHandle

_END = object()  # a worker's stream ended
_MOVE = object()  # the router moves the generation to another worker
# How long a finished worker's stream may take to end by itself before its read is cancelled
STREAM_END_GRACE_S = 5.0


@dataclass(frozen=True)
class EngineRequest:
    """A request as the router runs it; a rerun's is resumed (`Generation`)."""

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    arrival: float  # time.monotonic() when the router received the HTTP request


class Moved(Exception):
    """The router moves the generation elsewhere (a planned migration, `Attempt.move`): the
    attempt ends at this point of its outputs, as if its worker had failed, but on purpose."""


class HandedBack(Exception):
    """A decode worker ended a prompt placed on it unstarted (its `start_within` passed
    while the worker's running requests had no TPOT slack for it): placed again, never
    local on that worker."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"{worker_id} handed the prompt back unstarted")
        self.worker_id = worker_id


class WorkerFailure(Exception):
    """A worker stream ended without finishing the request. `refused_by`: the worker whose
    address refused the connection (its process is gone), which the pool suspends."""

    def __init__(
        self, worker_id: str, message: str, refused_by: WorkerHandle | None = None
    ) -> None:
        super().__init__(f"worker {worker_id}: {message}")
        self.worker_id = worker_id
        self.refused_by = refused_by


@dataclass
class Timings:
    """Seconds per phase, and the attempt's placement (`placement.py`: its kind and why),
    as reported in `baton_timings`. Up to the first token they add up to the router's TTFT:
    router_queue (arrival → the attempt began), ingress (the worker took the request to
    its scheduler), prefill_queue, prefill_compute (to the scheduler's first-token stamp),
    first_token_delivery (the rest: that stamp → the router got the token, with the
    request's trip to the worker). first_text_wait: the router held the first token's text
    back (bytes short of a character, a possible stop string) until a later token; a
    client reads no content before it. kv_transfer and decode_admission come after it."""

    router_queue: float = 0.0
    ingress: float = 0.0
    prefill_queue: float = 0.0
    prefill_compute: float = 0.0
    first_token_delivery: float = 0.0
    first_text_wait: float = 0.0
    kv_transfer: float = 0.0
    decode_admission: float = 0.0
    placement: str = ""  # empty for an aggregated worker
    placement_reason: str = ""
    # the cost placement's predicted TTFT of its option (s), for the router's phases up to
    # the first token (first_text_wait aside) to be held against; 0: not predicted
    predicted_ttft: float = 0.0
    # the decode worker that handed this prompt back unstarted before this placement (it
    # was placed local there and could not start in time; router_queue counts that wait)
    handed_back_by: str = ""
    # time.monotonic(): the attempt began; its first token reached the router (0: not yet)
    began: float = field(default_factory=time.monotonic, repr=False, metadata={"clock": True})
    first_token_at: float = field(default=0.0, repr=False, metadata={"clock": True})
    first_text_at: float = field(default=0.0, repr=False, metadata={"clock": True})

    def note(self, role: int, reported: dict[str, float]) -> None:
        """`reported`: a worker's `TokenOut.timings` (a phase it did not time is 0)."""
        # the worker that computed the prompt: P, an aggregated worker, or a D placed
        # "local" (a D given P's KV times no prefill)
        if role in (pb.BOTH, pb.PREFILL) or reported.get("prefill", 0.0) > 0:
            self.ingress = max(self.ingress, reported.get("ingress", 0.0))
            self.prefill_queue = max(self.prefill_queue, reported.get("queue", 0.0))
            self.prefill_compute = max(self.prefill_compute, reported.get("prefill", 0.0))
        if role in (pb.BOTH, pb.DECODE):
            admission = reported.get("decode_admission", 0.0)
            self.decode_admission = max(self.decode_admission, admission)
        self.kv_transfer = max(self.kv_transfer, reported.get("kv_transfer", 0.0))
        self._delivery()

    def token_arrived(self) -> None:
        """A response with tokens reached the router: the first one's time is kept."""
        if not self.first_token_at:
            self.first_token_at = time.monotonic()
            self._delivery()

    def text_sent(self) -> None:
        """The router sent the generation's first text (a client's first content)."""
        if self.first_token_at and not self.first_text_at:
            self.first_text_at = time.monotonic()
            self.first_text_wait = self.first_text_at - self.first_token_at

    def _delivery(self) -> None:
        if self.first_token_at:
            worker = self.ingress + self.prefill_queue + self.prefill_compute
            self.first_token_delivery = max(0.0, self.first_token_at - self.began - worker)

    def as_dict(self) -> dict[str, float | str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if "clock" not in f.metadata}

    @staticmethod
    def worst(all_timings: Sequence[Timings]) -> Timings:
        """Field-wise maximum (the slowest of several generations of one request); the
        first generation's placement."""
        worst = Timings()
        for t in all_timings:
            for name, value in t.as_dict().items():
                if isinstance(value, str):
                    setattr(worst, name, getattr(worst, name) or value)
                else:
                    setattr(worst, name, max(getattr(worst, name), value))
        return worst


class Attempt:
    """The streams of one attempt. `close()` (always, however the attempt ended) cancels
    the streams and sends `Abort` to every worker not marked `done`."""

    def __init__(self, request_id: str, abort: Callable[[WorkerHandle, str], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[tuple[WorkerHandle | None, Any]] = asyncio.Queue()
        self._abort = abort
        self._workers: list[WorkerHandle] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._done: set[str] = set()
        self._ended: set[str] = set()  # streams over: no longer counted in `in_flight`
        self._owed: tuple[WorkerHandle, int] | None = None

    def start(self, worker: WorkerHandle, request: pb.GenerateRequest) -> None:
        """Send `request` to `worker`; its responses arrive through `next()`. Calls started
        back to back go out in the same event-loop step."""
        worker.in_flight += 1
        self._workers.append(worker)
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(worker, request)))

    def ended(self, worker: WorkerHandle) -> None:
        """`worker`'s stream is over (P's, after its first token and its KV): it no longer
        counts the request in flight, though it is aborted on close unless `done` (its
        send may still be under way). The cost model read P's in-flight count as its
        queue: held until D's last token, it made an idle P look seconds behind."""
        if worker.worker_id not in self._ended and worker in self._workers:
            self._ended.add(worker.worker_id)
            worker.in_flight -= 1

    def owe(self, worker: WorkerHandle, tokens: int) -> None:
        """`worker` computes `tokens` of this attempt's prompt (P, or D placed local):
        counted on it until the first token is back (`settle`) or the attempt ends."""
        self.settle()
        worker.owed_prompts.append(tokens)
        self._owed = (worker, tokens)

    def settle(self) -> None:
        if self._owed is not None:
            worker, tokens = self._owed
            worker.owed_prompts.remove(tokens)
            self._owed = None

    def uses(self, worker_id: str) -> bool:
        return any(w.worker_id == worker_id for w in self._workers)

    def worker_left(self, worker_id: str) -> None:
        """The worker left the cluster (lease lapsed, deregistered, replaced): its stream
        fails now rather than when its channel closes."""
        for worker in self._workers:
            if worker.worker_id == worker_id and worker_id not in self._done:
                self.queue.put_nowait((worker, WorkerFailure(worker_id, "left the cluster")))

    def move(self) -> None:
        """End the attempt on purpose: its reader gets `Moved` after the outputs already
        received, and what the workers send after is dropped (their Abort follows)."""
        self.queue.put_nowait((None, _MOVE))

    def done(self, *workers: WorkerHandle) -> None:
        """These workers are finished with the request: no Abort owed."""
        self._done.update(w.worker_id for w in workers)

    def close(self) -> None:
        self.settle()
        for worker, task in zip(self._workers, self._tasks, strict=True):
            if worker.worker_id in self._done and not task.done():
                # Its stream ends by itself right after the finish it sent. Cancelled, the
                # read would leave grpc's call, its CANCELLED status and the tracebacks in
                # reference cycles (~50 objects a call) that only a full collection frees.
                task.get_loop().call_later(STREAM_END_GRACE_S, task.cancel)
            else:
                task.cancel()
        for worker in self._workers:
            if worker.worker_id not in self._ended:
                worker.in_flight -= 1
            if worker.worker_id not in self._done:
                call = self._calls.get(worker.worker_id)
                if call is not None:
                    call.cancel()
                self._abort(worker, self.request_id)
        self._workers.clear()
        self._tasks.clear()
        self._ended.clear()

    async def _pump(self, worker: WorkerHandle, request: pb.GenerateRequest) -> None:
        try:
            call = self._calls[worker.worker_id] = tracing.generate(worker, request)
            async for response in call:
                self.queue.put_nowait((worker, response_from_proto(response, self.request_id)))
            self.queue.put_nowait((worker, _END))
        except asyncio.CancelledError:
            if _cancelling():
                raise  # close(): nobody reads the queue any more
            # grpc.aio cancels the calls of a channel that is closed under them.
            failure = WorkerFailure(worker.worker_id, "stream cancelled (channel closed)")
            self.queue.put_nowait((worker, failure))
        except grpc.aio.AioRpcError as e:
            message = f"{e.code().name}: {e.details()}"
            # UNAVAILABLE is also what a draining worker answers; only a channel that
            # failed to connect says the address refuses.
            refused = e.code() == grpc.StatusCode.UNAVAILABLE and worker.refused()
            failure = WorkerFailure(worker.worker_id, message, worker if refused else None)
            self.queue.put_nowait((worker, failure))
        except Exception as e:
            self.queue.put_nowait((worker, WorkerFailure(worker.worker_id, repr(e))))

    async def next(self, timings: Timings) -> tuple[WorkerHandle, TokenOut | None]:
        """The next response of any stream (None: that stream ended). Raises WorkerFailure
        for a failed call or a response that reports an error or abort."""
        worker, item = await self.queue.get()
        if item is _MOVE:
            raise Moved()
        assert worker is not None
        if isinstance(item, WorkerFailure):
            raise item
        if item is _END:
            return worker, None
        if item.finish_reason in ("error", "abort"):
            raise WorkerFailure(worker.worker_id, item.error or item.finish_reason)
        if item.token_ids:
            timings.token_arrived()
        if item.timings:
            timings.note(worker.role, item.timings)
        return worker, item


def _cancelling() -> bool:
    """Whether the running task is being cancelled (asked here, not in the caller, whose
    frame the exception's traceback keeps: a local naming the task would close a cycle)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def grpc_request(
    request: EngineRequest,
    request_id: str,
    room: int = 0,
    peer: pb.PeerInfo | None = None,
    start_within: float = 0.0,
) -> pb.GenerateRequest:
    return request_to_proto(
        request_id, request.input_ids, request.sampling, room, peer, start_within
    )
