"""Running one generation on the cluster: pick workers, stream their tokens, rerun, abort.

Two modes, chosen per attempt: prefill/decode (PD) whenever a compatible prefill + decode
pair is registered, else aggregated (a worker of role BOTH).

PD: each attempt is placed (`placement.py`, `--placement`): `local` sends `Generate` to D
alone, without a room or a peer, and D computes the prompt itself; `disagg-delta` and
`disagg-full` send it to D and to P at the same time, naming each other and a fresh
`room`. P's stream carries the first token and ends; D's stream carries tokens 2..n and
the finish. The first token is passed on as soon as P sends it; anything D sends before
that waits behind it. Each placement is counted, and named in the response's timings.

An attempt that fails is run again, up to `MAX_ATTEMPTS` in all, avoiding the worker that
failed when others exist. A rerun resumes where the client's stream stands: its prompt is
the original prompt plus every token already passed on, its budget what is left, and its
sampling continues at the same seed's position (`SamplingParams.output_offset`; a sampled
request without a seed gets one here, so that it can be resumed). Greedy output is
token-exact with an uninterrupted run. A rerun after output is a *migration*; before, a
*retry*. A rerun waits a short, jittered back-off (`rerun_backoff`) and places itself
anew from the pool, so that it sees the registrations meanwhile. A worker whose address
refused the connection is suspended in the pool at once (`workers.py`); an attempt that
then finds no worker waits while the suspended one may return (a worker restarted at once
on its port), bounded by the suspension. Nothing reruns once the consumer stopped (client
gone): that closes the generation. Whenever an attempt ends without finishing (failure,
client gone, stop string matched by the caller), its streams are cancelled and every
worker still holding the request is sent `Abort`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc.aio
import msgspec

from baton.common.protocol import TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import request_to_proto
from baton.common.sampling import SamplingParams
from baton.services.router import precopy, tracing
from baton.services.router.attempt import Attempt, Moved, Timings, WorkerFailure
from baton.services.router.kv_index import KVIndex
from baton.services.router.measurements import bytes_per_token
from baton.services.router.metrics import RouterMetrics
from baton.services.router.migration import (
    MigrationReport,
    Move,
    UnknownWorker,
    check_request,
    check_target,
    plan_moves,
    wait_moves,
)
from baton.services.router.placement import Placement, Slo
from baton.services.router.placer import Placer
from baton.services.router.policies import Policy
from baton.services.router.workers import WorkerHandle, WorkerPool, prefer

__all__ = [
    "Dispatcher",
    "EngineRequest",
    "Generation",
    "NoWorkersAvailable",
    "Timings",
    "WorkerFailure",
]

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # the first run, then retries or migrations
MIGRATED = "migrated"  # a worker's finish reason: it handed the request off (live)
RERUN_BACKOFF_S = 0.05  # before the first rerun; four times as long before the next
ABORT_TIMEOUT_S = 2.0


class NoWorkersAvailable(Exception):
    """No aggregated worker and no compatible prefill/decode pair is known."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    arrival: float  # time.monotonic() when the router received the HTTP request


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        policy: Policy,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics | None = None,
        placement: str = "always-disagg",
        slo: Slo = Slo(),
        exact: KVIndex | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.placer = Placer(pool, self.pick_pair, placement, slo, exact, metrics)
        self._policy = policy
        self._prefill_policy = prefill_policy
        self._decode_policy = decode_policy
        self._aborts: set[asyncio.Task[None]] = set()
        self._attempts: set[Attempt] = set()  # running, to fail when one of their workers leaves
        self._generations: dict[str, Generation] = {}  # running, by request id
        for p in (policy, prefill_policy, decode_policy):
            pool.on_removed(p.forget)
        pool.on_removed(self._worker_left)

    def available(self) -> bool:
        """Whether a request can be served: by a worker now, or by one expected back."""
        return self.pool.usable() or self.pool.expects_return()

    def worker_refused(self, worker: WorkerHandle) -> None:
        if self.pool.suspend(worker) and self.metrics is not None:
            self.metrics.worker_suspensions.inc()

    async def wait_for_worker(self) -> None:
        """Wait while no worker can serve but a suspended one may return; raises
        NoWorkersAvailable when none came."""
        served = await self.pool.wait_usable()
        if self.metrics is not None:
            self.metrics.waits_for_worker.labels("served" if served else "gave_up").inc()
        if not served:
            raise NoWorkersAvailable("no worker is available")

    def generation(self, request: EngineRequest) -> Generation:
        return Generation(self, request)

    async def close(self) -> None:
        """Wait (briefly) for Abort calls still in flight."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)

    def track(self, attempt: Attempt) -> None:
        self._attempts.add(attempt)

    def untrack(self, attempt: Attempt) -> None:
        self._attempts.discard(attempt)

    def running(self, generation: Generation) -> None:
        self._generations[generation.request.request_id] = generation

    def ended(self, generation: Generation) -> None:
        if self._generations.get(generation.request.request_id) is generation:
            del self._generations[generation.request.request_id]

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
        plans = plan_moves(self.pool, chosen, target, self._choose_target)
        moves = {g.request.request_id: g.move_to(t, reason) for g, t in plans}
        moved, finished = await wait_moves(moves)
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
        return MigrationReport(moved, finished, not_running)

    def live_capable(self, source: WorkerHandle, target: WorkerHandle) -> bool:
        """Whether `source` can hand a request to `target` with its pages (live migration):
        decode workers both, of one KV layout, the source without tensor parallelism (its
        pages would have to be gathered from its ranks first)."""
        return (
            source.role == pb.DECODE
            and target.role == pb.DECODE
            and source.info.layout.tp_size <= 1
            and self.pool.compatible(source, target)
        )

    def ask_live(
        self,
        source: WorkerHandle,
        request_id: str,
        move: _PendingMove,
        context: Callable[[], Sequence[int]],
        refused: Callable[[int, str, bool], None],
    ) -> None:
        """Copy the pages of `context()` (it grows) to the move's target ahead
        (`precopy.py`), then ask `source` to hand `request_id` off to it in the move's room;
        `refused(room, why, ended)` when it would not or could not be asked (`ended`: the
        request is no longer streaming there: its last outputs are on their way)."""
        room, target = move.room, move.target

        async def ask() -> None:
            move.warmed = await precopy.warm_rounds(source, target, request_id, context)
            if move.room != room or move.done.done():
                return  # refused, ended or moved otherwise meanwhile
            request = pb.MigrateRequest(request_id=request_id, room=room, peer=target.peer())
            try:
                await source.stub.Migrate(request, timeout=ABORT_TIMEOUT_S)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
                rpc = isinstance(e, grpc.aio.AioRpcError)
                details = e.details() if rpc else str(e)
                ended = rpc and e.code() == grpc.StatusCode.NOT_FOUND
                refused(room, f"{source.worker_id}: {details}", ended)

        task = asyncio.get_running_loop().create_task(ask())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def _choose_target(self, options: list[WorkerHandle], input_ids: list[int]) -> WorkerHandle:
        policy = self._policy if options[0].role == pb.BOTH else self._decode_policy
        return policy.choose(options, input_ids)

    def placed_on(
        self, input_ids: Sequence[int], decode: WorkerHandle, why: str
    ) -> tuple[Placement, WorkerHandle | None, WorkerHandle]:
        """A PD attempt on `decode` (a migration's target): P chosen by the prefill policy
        among D's compatible partners, else local on D."""
        prefills = [p for p in self.pool.workers(pb.PREFILL) if self.pool.compatible(p, decode)]
        prefill = self._prefill_policy.choose(prefills, input_ids) if prefills else None
        return self.placer.placed(list(input_ids), prefill, decode, why), prefill, decode

    def _worker_left(self, worker_id: str) -> None:
        for attempt in list(self._attempts):
            attempt.worker_left(worker_id)

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
        workers = prefer(self.pool.workers(pb.BOTH), avoid)
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
        prefill = self._prefill_policy.choose(prefer(prefills, avoid), input_ids)
        decode = self._decode_policy.choose(prefer(partners[prefill.worker_id], avoid), input_ids)
        return prefill, decode


class Generation:
    """One generation's outputs, as the workers' own `TokenOut`s: each has new tokens or
    a finish reason ("stop" | "length" on the one that ends the generation), and its
    logprobs and prompt logprobs when asked for. Iterate `outputs()` inside
    `contextlib.aclosing` so that an early exit aborts the workers at once. `timings` and
    `cached_tokens` fill in as responses arrive. `move_to` moves it to another worker
    (`migration.py`)."""

    def __init__(self, dispatcher: Dispatcher, request: EngineRequest) -> None:
        self._dispatcher = dispatcher
        sampling = request.sampling
        if not sampling.greedy and sampling.seed is None:
            # A seed of our own: a migrated run continues the same random sequence.
            sampling = sampling.replace(seed=random.getrandbits(63))
        self.request = EngineRequest(
            request.request_id, request.input_ids, sampling, request.arrival
        )
        self.timings = Timings()
        self.cached_tokens = 0
        self.worker: WorkerHandle | None = None  # the worker decoding the current attempt
        self._passed_on: list[int] = []  # token ids the consumer has been given
        self._current: Attempt | None = None
        self._move: _PendingMove | None = None
        self._last_output = 0.0  # time.monotonic() of the last output passed on
        self._live_from = ""  # the source whose pages the current attempt continues from
        self._longest_gap: float | None = None  # between outputs, once migrated

    @property
    def worker_id(self) -> str | None:
        return self.worker.worker_id if self.worker is not None else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def input_ids(self) -> list[int]:
        return self.request.input_ids

    def move_to(self, target: WorkerHandle, reason: str) -> asyncio.Future[Move | None]:
        """Move the generation to `target` at its next output. The future is the `Move` once
        the next attempt started there, None if the generation ended first (a move already
        pending keeps its target)."""
        if self._move is not None:
            return self._move.done
        done: asyncio.Future[Move | None] = asyncio.get_running_loop().create_future()
        move = self._move = _PendingMove(target, reason, self.worker_id or "", done)
        source, attempt = self.worker, self._current
        if source is None or attempt is None:
            return done  # (an attempt not placed yet takes the move when it places)
        if self._dispatcher.live_capable(source, target):
            move.room = random.getrandbits(63) | 1
            self._dispatcher.ask_live(
                source, attempt.request_id, move, self._context, self._refused
            )
        else:
            attempt.move()
        return done

    def _context(self) -> list[int]:
        """The prompt and every token passed on."""
        return self.request.input_ids + self._passed_on

    def _refused(self, room: int, why: str, ended: bool) -> None:
        """The source refused to hand the request off (live): move it by recompute, unless
        it `ended` there (its finish is on its way: nothing is left to move)."""
        move = self._move
        if move is None or move.room != room or move.handed_off or self.worker_id != move.source:
            return
        if ended:
            self._move = None
            if not move.done.done():
                move.done.set_result(None)  # reported under "finished"
            return
        log.warning("request %s: live migration refused (%s); recompute", self.request_id, why)
        move.room = 0
        if self._current is not None and self.worker is not None:
            self._current.move()

    def _handed_off(self, attempt: Attempt, worker: WorkerHandle, output: TokenOut) -> TokenOut:
        """`worker` stopped the request and handed it off (live migration): its last
        output, passed on as an ordinary one; the next attempt continues on the target (or,
        when no move waits for it, recomputes)."""
        attempt.done(worker)
        if self._move is not None:
            self._move.handed_off = True
        return msgspec.structs.replace(output, finished=False, finish_reason="")

    async def outputs(self) -> AsyncIterator[TokenOut]:
        avoid: set[str] = set()
        failures = 0
        self._dispatcher.running(self)
        try:
            for attempt_no in itertools.count():
                suffix = f"-retry{attempt_no}" if attempt_no else ""
                attempt = Attempt(self.request.request_id + suffix, self._dispatcher.abort_later)
                self._current = attempt
                self._dispatcher.track(attempt)
                moved = False
                try:
                    resumed = self._resumed()
                    if resumed is None:  # every token was passed on; only the finish was lost
                        yield TokenOut(
                            attempt.request_id, [], finished=True, finish_reason="length"
                        )
                        return
                    async for output in self._attempt(attempt, resumed, avoid):
                        self._passed(output)
                        yield output
                    return
                except Moved:
                    moved = True
                    tracing.rerun("migration", "moved by the router")
                except WorkerFailure as e:
                    if e.refused_by is not None:
                        self._dispatcher.worker_refused(e.refused_by)
                    failures += 1
                    if failures == MAX_ATTEMPTS:
                        raise
                    self._failed(attempt, e)
                    # A live attempt fails with its source's pages: the source is to blame.
                    avoid.add(self._live_from or e.worker_id)
                finally:
                    self._dispatcher.untrack(attempt)
                    attempt.close()
                    self._current = self.worker = None
                    self._live_from = ""
                if not moved:
                    await asyncio.sleep(rerun_backoff(failures - 1))
        finally:
            self._dispatcher.ended(self)
            if self._move is not None and not self._move.done.done():
                self._move.done.set_result(None)
            metrics = self._dispatcher.metrics
            if self._longest_gap is not None and metrics is not None:
                metrics.migration_stall.observe(self._longest_gap)

    def _passed(self, output: TokenOut) -> None:
        self._passed_on.extend(output.token_ids)
        now = time.monotonic()
        if self._longest_gap is not None:
            self._longest_gap = max(self._longest_gap, now - self._last_output)
        self._last_output = now

    def _failed(self, attempt: Attempt, e: WorkerFailure) -> None:
        kind = "migration" if self._passed_on else "retry"
        log.warning(
            "request %s: %s; %s after %d tokens",
            attempt.request_id,
            e,
            kind,
            len(self._passed_on),
        )
        metrics = self._dispatcher.metrics
        if metrics is not None:
            metrics.reruns.labels(kind).inc()
            if kind == "migration":
                metrics.migrations.labels("recompute", "worker_failed").inc()
        if kind == "migration":
            self._migrated()
        tracing.rerun(kind, str(e))

    def _migrated(self) -> None:
        """The stream continues on another worker: from here its longest gap is measured."""
        if self._longest_gap is None:
            self._longest_gap = 0.0
            if not self._passed_on:  # (a move before any output: from the request's arrival)
                self._last_output = self.request.arrival

    def _moving(self, avoid: set[str]) -> WorkerHandle | None:
        """The pending move's target, if it still serves (else placed as usual, away from
        the move's source)."""
        move = self._move
        if move is None:
            return None
        target = self._dispatcher.pool.get(move.target.worker_id)
        if target is not move.target or target not in self._dispatcher.pool.workers(target.role):
            log.warning(
                "request %s: target %s of its move no longer serves; placed anew",
                self.request.request_id,
                move.target.worker_id,
            )
            if move.source:
                avoid.add(move.source)
            return None
        return target

    def _took_over(self, target: WorkerHandle, request: EngineRequest, kind: str) -> None:
        """The pending move's next attempt started on `target`: its pages copied there
        (`kind` live: `request`'s prompt is the context they hold) or computed again."""
        move, self._move = self._move, None
        assert move is not None
        self._migrated()
        metrics = self._dispatcher.metrics
        if metrics is not None:
            metrics.migrations.labels(kind, move.reason).inc()
            if kind == "live":
                context = len(request.input_ids) * bytes_per_token(target.info.layout)
                metrics.migration_bytes.inc(context)
                pages = -(-len(request.input_ids) // target.info.layout.page_size)
                metrics.migration_pages.labels("precopy").inc(move.warmed)
                metrics.migration_pages.labels("cutover").inc(max(0, pages - move.warmed))
            else:
                metrics.migration_recomputed_tokens.inc(len(request.input_ids))
        done = Move(
            self.request.request_id, move.source, target.worker_id, kind, len(self._passed_on)
        )
        if not move.done.done():
            move.done.set_result(done)

    def _resumed(self, held_back: int = 0) -> EngineRequest | None:
        """The request as the next attempt runs it: resumed after the tokens passed on but
        the last `held_back` (a live migration's target has the last as its first token)."""
        done = len(self._passed_on) - held_back
        if not done:
            return self.request
        sampling = self.request.sampling
        if done >= sampling.max_new_tokens:
            return None
        resumed = sampling.replace(
            max_new_tokens=sampling.max_new_tokens - done,
            min_new_tokens=max(0, sampling.min_new_tokens - done),
            output_offset=sampling.output_offset + done,
            prompt_logprobs=None,  # the first run delivered them with its first token
        )
        input_ids = self.request.input_ids + self._passed_on[:done]
        return EngineRequest(self.request.request_id, input_ids, resumed, self.request.arrival)

    async def _attempt(
        self, attempt: Attempt, request: EngineRequest, avoid: set[str]
    ) -> AsyncIterator[TokenOut]:
        placing = tracing.placing()
        target = self._moving(avoid)
        move = self._move
        if target is not None and move is not None and move.handed_off and move.room:
            source = self._dispatcher.pool.get(move.source)
            live = self._resumed(held_back=1)
            if source is not None and live is not None:
                tracing.placed(placing, None, target)
                self._begin()
                self.worker, self._live_from = target, source.worker_id
                self._took_over(target, live, "live")
                peer = source.peer()
                async for output in self._single(attempt, live, target, move.room, peer):
                    yield output
                return
        placed = worker = None
        if target is not None and target.role == pb.DECODE:
            placed = self._dispatcher.placed_on(request.input_ids, target, "migration")
        elif target is not None:
            worker = target
        while placed is None and worker is None:
            placed = self._dispatcher.placer.place(request.input_ids, avoid)
            worker = None if placed else self._dispatcher.pick_single(request.input_ids, avoid)
            if placed is None and worker is None:
                await self._dispatcher.wait_for_worker()
        if placed is not None:
            placement, prefill, decode = placed
            tracing.placed(placing, placement, prefill, decode)
            self._begin(placement)
            self.worker = decode
            if prefill is None:  # local: D computes the prompt itself
                outputs = self._single(attempt, request, decode)
            else:
                outputs = self._pd(attempt, request, prefill, decode)
        else:
            assert worker is not None
            tracing.placed(placing, None, worker)
            self._begin()
            self.worker = worker
            outputs = self._single(attempt, request, worker)
        if self._move is not None:  # (on its target, or placed anew when that left)
            self._took_over(self.worker, request, "recompute")
        async for output in outputs:
            yield output

    async def _single(
        self,
        attempt: Attempt,
        request: EngineRequest,
        worker: WorkerHandle,
        room: int = 0,
        source: pb.PeerInfo | None = None,
    ) -> AsyncIterator[TokenOut]:
        """One worker computes the prompt and decodes (aggregated, or D placed local), or,
        with a room, continues a live migration from `source`'s pages."""
        attempt.start(worker, _grpc_request(request, attempt.request_id, room, source))
        while True:
            _, response = await attempt.next(self.timings)
            if response is None:
                raise WorkerFailure(worker.worker_id, "stream ended before the request finished")
            if output := self._output(response):
                if output.finish_reason == MIGRATED:
                    yield self._handed_off(attempt, worker, output)
                    raise Moved()
                if output.finish_reason:
                    # Marked before the yield: a consumer may stop at the finishing output.
                    attempt.done(worker)
                    self._finished_on(worker, output)
                    self._count_computed(output)
                yield output
                if output.finish_reason:
                    return

    async def _pd(
        self,
        attempt: Attempt,
        request: EngineRequest,
        prefill: WorkerHandle,
        decode: WorkerHandle,
    ) -> AsyncIterator[TokenOut]:
        room = random.getrandbits(63) | 1
        attempt.start(decode, _grpc_request(request, attempt.request_id, room, prefill.peer()))
        attempt.start(prefill, _grpc_request(request, attempt.request_id, room, decode.peer()))
        first: TokenOut | None = None  # P's first token, once passed on
        held: list[TokenOut] = []  # D's outputs that arrived before P's first token
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
                self._count_computed(first)
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
                if output.finish_reason == MIGRATED:
                    attempt.done(prefill)
                    yield self._handed_off(attempt, decode, output)
                    raise Moved()
                if output.finish_reason:
                    attempt.done(prefill, decode)
                    self._finished_on(decode, output)
                yield output
                if output.finish_reason:
                    return

    def _begin(self, placement: Placement | None = None) -> None:
        self.timings = Timings(router_queue=time.monotonic() - self.request.arrival)
        if placement is not None:
            self.timings.placement = placement.kind
            self.timings.placement_reason = placement.reason

    def _finished_on(self, worker: WorkerHandle, last: TokenOut) -> None:
        if worker.role == pb.DECODE:
            answer = self._passed_on + last.token_ids
            self._dispatcher.placer.remember(self.request.input_ids + answer, worker)

    def _count_computed(self, answer: TokenOut) -> None:
        """The prompt tokens the placed worker computed (its cache held the others), by
        placement kind; `answer` is its last output."""
        metrics = self._dispatcher.metrics
        if metrics is not None and self.timings.placement:
            computed = max(0, answer.prompt_tokens - answer.cached_tokens)
            metrics.placement_prefill_tokens.labels(self.timings.placement).inc(computed)

    def _output(self, response: TokenOut) -> TokenOut | None:
        """`response`, unless it carries neither tokens nor the finish."""
        # A resumed run's prompt includes earlier output: only the original prompt counts.
        cached = min(response.cached_tokens, len(self.request.input_ids))
        self.cached_tokens = max(self.cached_tokens, cached)
        if not response.token_ids and not response.finish_reason:
            return None
        return response


@dataclass
class _PendingMove:
    target: WorkerHandle
    reason: str
    source: str  # worker id ('' between attempts)
    done: asyncio.Future[Move | None]
    room: int = 0  # live: the room the source sends the pages in (0: recompute)
    handed_off: bool = False  # live: the source stopped the request, its pages wait
    warmed: int = 0  # live: pages of the context copied to the target's cache ahead


def rerun_backoff(reruns_before: int) -> float:
    """Seconds to wait before a rerun, after `reruns_before` earlier ones: jittered, so that
    the streams of one failed worker do not all come back in the same instant."""
    return RERUN_BACKOFF_S * 4**reruns_before * random.uniform(0.5, 1.0)


def _grpc_request(
    request: EngineRequest, request_id: str, room: int = 0, peer: pb.PeerInfo | None = None
) -> pb.GenerateRequest:
    return request_to_proto(request_id, request.input_ids, request.sampling, room, peer)
