"""Running one generation on the cluster: pick workers, stream their tokens, retry, abort.

Two modes, chosen per attempt: prefill/decode (PD) whenever a compatible prefill + decode
pair is registered, else aggregated (a worker of role BOTH).

PD: the router sends `Generate` to D and to P at the same time, naming each other and a
fresh `room`. P's stream carries the first token and ends; D's stream carries tokens 2..n
and the finish. The first token is passed on as soon as P sends it; anything D sends
before that waits behind it.

An attempt that fails before anything was passed on is retried once, avoiding the
worker(s) that failed when others exist. Whenever an attempt ends without finishing
(failure, client gone, stop string matched by the caller), its streams are cancelled
and every worker still holding the request is sent `Abort`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc.aio

from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import request_to_proto
from baton.common.sampling import SamplingParams
from baton.services.router.policies import Policy
from baton.services.router.workers import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2
ABORT_TIMEOUT_S = 2.0
_END = object()  # a worker's stream ended


class NoWorkersAvailable(Exception):
    """No aggregated worker and no compatible prefill/decode pair is known."""


class WorkerFailure(Exception):
    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(f"worker {worker_id}: {message}")
        self.worker_id = worker_id


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    arrival: float  # time.monotonic() when the router received the HTTP request


@dataclass
class Timings:
    """Seconds per phase, as reported in `baton_timings`."""

    router_queue: float = 0.0
    prefill_queue: float = 0.0
    prefill_compute: float = 0.0
    kv_transfer: float = 0.0
    decode_admission: float = 0.0

    def note(self, role: int, reported: pb.Timings) -> None:
        if role in (pb.BOTH, pb.PREFILL):
            self.prefill_queue = max(self.prefill_queue, reported.queue)
            self.prefill_compute = max(self.prefill_compute, reported.prefill)
        if role in (pb.BOTH, pb.DECODE):
            self.decode_admission = max(self.decode_admission, reported.decode_admission)
        self.kv_transfer = max(self.kv_transfer, reported.kv_transfer)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @staticmethod
    def worst(all_timings: Sequence[Timings]) -> Timings:
        """Field-wise maximum (the slowest of several generations of one request)."""
        worst = Timings()
        for t in all_timings:
            for name, value in asdict(t).items():
                setattr(worst, name, max(getattr(worst, name), value))
        return worst


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob]  # one per token, when asked for
    finish_reason: str | None  # "stop" | "length" on the output that ends the generation
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # with the first


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: Policy,
        prefill_policy: Policy,
        decode_policy: Policy,
    ) -> None:
        self.pool = pool
        self._policy = policy
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._aborts: set[asyncio.Task[None]] = set()
        for p in (policy, prefill_policy, decode_policy):
            pool.on_removed(p.forget)

    def available(self) -> bool:
        return self.pool.usable()

    def generation(self, request: EngineRequest) -> Generation:
        return Generation(self, request)

    async def close(self) -> None:
        """Wait (briefly) for Abort calls still in flight."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)

    def abort_later(self, worker: WorkerHandle, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(worker, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, worker: WorkerHandle, request_id: str) -> None:
        try:
            await worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.debug("abort %s on %s: %s", request_id, worker.worker_id, e)

    def pick_single(self, input_ids: Sequence[int], avoid: set[str]) -> WorkerHandle | None:
        workers = _prefer(self.pool.workers(pb.BOTH), avoid)
        return self._policy.choose(workers, input_ids) if workers else None

    def pick_pair(
        self, input_ids: Sequence[int], avoid: set[str]
    ) -> tuple[WorkerHandle, WorkerHandle] | None:
        decodes = self.pool.workers(pb.DECODE)
        partners = {
            p.worker_id: [d for d in decodes if self.pool.compatible(p, d)]
            for p in self.pool.workers(pb.PREFILL)
        }
        prefills = [p for p in self.pool.workers(pb.PREFILL) if partners[p.worker_id]]
        if not prefills:
            return None
        # Only P with at least one compatible D are candidates; D among P's partners.
        prefill = self._prefill_policy.choose(_prefer(prefills, avoid), input_ids)
        decode = self._decode_policy.choose(_prefer(partners[prefill.worker_id], avoid), input_ids)
        return prefill, decode


class _Attempt:
    """The streams of one attempt, and the cleanup owed when it ends."""

    def __init__(self, request_id: str, abort: Callable[[WorkerHandle, str], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[tuple[WorkerHandle, Any]] = asyncio.Queue()
        self._abort = abort
        self._workers: list[WorkerHandle] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._done: set[str] = set()

    def start(self, worker: WorkerHandle, request: pb.GenerateRequest) -> None:
        """Send `request` to `worker`; its responses arrive through `next()`. Calls started
        back to back go out in the same event-loop step."""
        worker.in_flight += 1
        self._workers.append(worker)
        self._tasks.append(asyncio.get_running_loop().create_task(self._pump(worker, request)))

    def done(self, *workers: WorkerHandle) -> None:
        """These workers are finished with the request: no Abort owed."""
        self._done.update(w.worker_id for w in workers)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self._workers:
            worker.in_flight -= 1
            if worker.worker_id not in self._done:
                call = self._calls.get(worker.worker_id)
                if call is not None:
                    call.cancel()
                self._abort(worker, self.request_id)
        self._workers.clear()
        self._tasks.clear()

    async def _pump(self, worker: WorkerHandle, request: pb.GenerateRequest) -> None:
        try:
            call = self._calls[worker.worker_id] = worker.stub.Generate(request)
            async for response in call:
                self.queue.put_nowait((worker, response))
            self.queue.put_nowait((worker, _END))
        except grpc.aio.AioRpcError as e:
            message = f"{e.code().name}: {e.details()}"
            self.queue.put_nowait((worker, WorkerFailure(worker.worker_id, message)))
        except Exception as e:  # e.g. its channel closed as the worker left the cluster
            self.queue.put_nowait((worker, WorkerFailure(worker.worker_id, repr(e))))

    async def next(self, timings: Timings) -> tuple[WorkerHandle, pb.GenerateResponse | None]:
        """The next response of any stream (None: that stream ended). Raises WorkerFailure
        for a failed call or a response that reports an error or abort."""
        worker, item = await self.queue.get()
        if isinstance(item, WorkerFailure):
            raise item
        if item is _END:
            return worker, None
        if item.finish_reason in ("error", "abort"):
            raise WorkerFailure(worker.worker_id, item.error_message or item.finish_reason)
        if item.HasField("timings"):
            timings.note(worker.role, item.timings)
        return worker, item


class Generation:
    """One generation's outputs. Iterate `outputs()` inside `contextlib.aclosing` so that
    an early exit aborts the workers at once. `timings` and `cached_tokens` fill in as
    responses arrive."""

    def __init__(self, dispatcher: Dispatcher, request: EngineRequest) -> None:
        self._dispatcher = dispatcher
        self.request = request
        self.timings = Timings()
        self.cached_tokens = 0

    async def outputs(self) -> AsyncIterator[Output]:
        avoid: set[str] = set()
        for attempt_no in range(MAX_ATTEMPTS):
            suffix = f"-retry{attempt_no}" if attempt_no else ""
            attempt = _Attempt(self.request.request_id + suffix, self._dispatcher.abort_later)
            passed_on = False
            try:
                async for output in self._attempt(attempt, avoid):
                    passed_on = True
                    yield output
                return
            except WorkerFailure as e:
                if passed_on or attempt_no == MAX_ATTEMPTS - 1:
                    raise
                log.warning(
                    "request %s failed before any output (%s); retrying",
                    attempt.request_id,
                    e,
                )
                avoid.add(e.worker_id)
            finally:
                attempt.close()

    async def _attempt(self, attempt: _Attempt, avoid: set[str]) -> AsyncIterator[Output]:
        input_ids = self.request.input_ids
        pair = self._dispatcher.pick_pair(input_ids, avoid)
        if pair is not None:
            self._begin()
            async for pd_output in self._pd(attempt, *pair):
                yield pd_output
            return
        worker = self._dispatcher.pick_single(input_ids, avoid)
        if worker is None:
            raise NoWorkersAvailable("no worker is available")
        self._begin()
        attempt.start(worker, self._grpc_request(attempt.request_id))
        while True:
            _, response = await attempt.next(self.timings)
            if response is None:
                raise WorkerFailure(worker.worker_id, "stream ended before the request finished")
            if output := self._output(response):
                if output.finish_reason:
                    # Marked before the yield: a consumer may stop at the finishing output.
                    attempt.done(worker)
                yield output
                if output.finish_reason:
                    return

    async def _pd(
        self, attempt: _Attempt, prefill: WorkerHandle, decode: WorkerHandle
    ) -> AsyncIterator[Output]:
        room = random.getrandbits(63) | 1
        attempt.start(decode, self._grpc_request(attempt.request_id, room, prefill.peer()))
        attempt.start(prefill, self._grpc_request(attempt.request_id, room, decode.peer()))
        first: Output | None = None  # P's first token, once passed on
        held: list[Output] = []  # D's outputs that arrived before P's first token
        decode_finished = False
        while True:
            try:
                worker, response = await attempt.next(self.timings)
            except WorkerFailure as e:
                if first is not None and e.worker_id == prefill.worker_id:
                    # P's part ended with its first token; D owns the request now and
                    # reports any transfer failure itself.
                    continue
                raise
            if worker is prefill:
                if response is None:
                    if first is None:
                        raise WorkerFailure(prefill.worker_id, "prefill ended without a token")
                    continue  # P may still be sending KV: it is aborted too if D never finishes
                output = self._output(response)
                if first is not None or output is None:
                    continue  # only timings matter after the first token
                first = output
                if first.finish_reason:
                    attempt.done(prefill)  # D is aborted on close: it has nothing to do
                yield first
                if first.finish_reason:
                    return
                pending, held = held, []
            else:
                if response is None:
                    if decode_finished:
                        continue  # its finish waits behind P's first token
                    raise WorkerFailure(decode.worker_id, "decode ended before finishing")
                output = self._output(response)
                if output is None:
                    continue
                decode_finished = output.finish_reason is not None
                if first is None:
                    held.append(output)
                    continue
                pending = [output]
            for output in pending:
                if output.finish_reason:
                    attempt.done(prefill, decode)
                yield output
                if output.finish_reason:
                    return

    def _begin(self) -> None:
        self.timings = Timings(router_queue=time.monotonic() - self.request.arrival)

    def _output(self, response: pb.GenerateResponse) -> Output | None:
        self.cached_tokens = max(self.cached_tokens, response.cached_tokens)
        if not response.token_ids and not response.finish_reason:
            return None
        return Output(
            token_ids=list(response.token_ids),
            logprobs=list(response.logprobs),
            finish_reason=response.finish_reason or None,
            prompt_logprobs=list(response.prompt_logprobs),
        )

    def _grpc_request(
        self, request_id: str, room: int = 0, peer: pb.PeerInfo | None = None
    ) -> pb.GenerateRequest:
        return request_to_proto(
            request_id, self.request.input_ids, self.request.sampling, room, peer
        )


def _prefer(workers: list[WorkerHandle], avoid: set[str]) -> list[WorkerHandle]:
    """`workers` without those in `avoid`, unless that leaves none."""
    return [w for w in workers if w.worker_id not in avoid] or workers
