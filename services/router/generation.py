"""One generation on the cluster, across its attempts: place each, rerun, move, abort.

Two modes, chosen per attempt: prefill/decode (PD) whenever a compatible prefill + decode
pair is registered, else aggregated (a worker of role BOTH). The workers are chosen by
`pairing.py`; a PD attempt is placed (`placement.py`, `--placement`) on D alone (`local`)
or split between P and D, each placement counted and named in the response's timings; the
attempt's streams are read by `attempt_streams.py`.

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

A move (`move_to`, `migration.py`) ends the current attempt on purpose; the next starts on
the target, live from the source's pages (`handoff.py`) or by recompute. The dispatcher
that runs the generation (`dispatch.py`) imports this module; the generation reaches it
only through `Cluster`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, Protocol

import msgspec

from baton.common.protocol import TokenOut
from baton.common.rpc import baton_pb2 as pb
from baton.services.router import tracing
from baton.services.router.attempt import (
    Attempt,
    EngineRequest,
    HandedBack,
    Moved,
    Timings,
    WorkerFailure,
)
from baton.services.router.attempt_streams import pd, single
from baton.services.router.handoff import PendingMove, ask_live, live_capable
from baton.services.router.measurements import bytes_per_token
from baton.services.router.migration import Move
from baton.services.router.pairing import WorkerChoice
from baton.services.router.placement import Placement
from baton.services.router.stream_gaps import StreamGaps
from baton.services.router.worker_handle import WorkerHandle

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # the first run, then retries or migrations
RERUN_BACKOFF_S = 0.05  # before the first rerun; four times as long before the next


class Cluster(Protocol):
    """What a generation asks of the dispatcher that runs it (`dispatch.py`)."""

    def track(self, attempt: Attempt) -> None:
        """`attempt` runs: fail it when one of its workers leaves the cluster."""

    def untrack(self, attempt: Attempt) -> None: ...

    def running(self, generation: Generation) -> None:
        """`generation` runs: `migrate` may move it."""

    def ended(self, generation: Generation) -> None: ...

    def abort_later(self, worker: WorkerHandle, request_id: str) -> None:
        """Send `worker` `Abort` for `request_id` in the background."""

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background; shutdown waits for it briefly."""


class Generation:
    """One generation's outputs, as the workers' own `TokenOut`s: each has new tokens or
    a finish reason ("stop" | "length" on the one that ends the generation), and its
    logprobs and prompt logprobs when asked for. Iterate `outputs()` inside
    `contextlib.aclosing` so that an early exit aborts the workers at once. `timings` and
    `cached_tokens` fill in as responses arrive. `move_to` moves it to another worker
    (`migration.py`)."""

    def __init__(self, cluster: Cluster, choice: WorkerChoice, request: EngineRequest) -> None:
        self._cluster = cluster
        self._choice = choice
        self._pool = choice.pool
        self._metrics = choice.metrics
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
        self._move: PendingMove | None = None
        self._live_from = ""  # the source whose pages the current attempt continues from
        self._handed_back_by = ""  # the decode worker that handed the prompt back, if one did
        self._gaps = StreamGaps()

    @property
    def worker_id(self) -> str | None:
        return self.worker.worker_id if self.worker is not None else None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def input_ids(self) -> list[int]:
        return self.request.input_ids

    @property
    def context_tokens(self) -> int:
        """The prompt and the tokens passed on."""
        return len(self.request.input_ids) + len(self._passed_on)

    def move_to(self, target: WorkerHandle, reason: str) -> asyncio.Future[Move | None]:
        """Move the generation to `target` at its next output. The future is the `Move` once
        the next attempt started there, None if the generation ended first (a move already
        pending keeps its target)."""
        if self._move is not None:
            return self._move.done
        done: asyncio.Future[Move | None] = asyncio.get_running_loop().create_future()
        move = self._move = PendingMove(target, reason, self.worker_id or "", done)
        source, attempt = self.worker, self._current
        if source is None or attempt is None:
            return done  # (an attempt not placed yet takes the move when it places)
        if live_capable(self._pool, source, target):
            move.room = random.getrandbits(63) | 1
            ask = ask_live(source, attempt.request_id, move, self._context, self._refused)
            self._cluster.background(ask)
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

    def handed_off(self, attempt: Attempt, worker: WorkerHandle, output: TokenOut) -> TokenOut:
        """`worker` stopped the request and handed it off (live migration): its last
        output, passed on as an ordinary one; the next attempt continues on the target (or,
        when no move waits for it, recomputes)."""
        attempt.done(worker)
        if self._move is not None:
            self._move.handed_off = True
        return msgspec.structs.replace(output, finished=False, finish_reason="")

    async def outputs(self) -> AsyncGenerator[TokenOut, None]:
        avoid: set[str] = set()
        no_local: set[str] = set()  # D's that handed the prompt back: never local there
        failures = 0
        self._cluster.running(self)
        try:
            for attempt_no in itertools.count():
                suffix = f"-retry{attempt_no}" if attempt_no else ""
                attempt = Attempt(self.request.request_id + suffix, self._cluster.abort_later)
                self._current = attempt
                self._cluster.track(attempt)
                moved = False
                try:
                    resumed = self._resumed()
                    if resumed is None:  # every token was passed on; only the finish was lost
                        yield TokenOut(
                            attempt.request_id, [], finished=True, finish_reason="length"
                        )
                        return
                    async for output in self._attempt(attempt, resumed, avoid, no_local):
                        attempt.settle()  # the prompt is computed: its first token is here
                        self._passed(output)
                        yield output
                    return
                except Moved:
                    moved = True
                    tracing.rerun("migration", "moved by the router")
                except HandedBack as e:
                    # (placed again at once: at most once per decode worker, never local
                    # on it again)
                    moved = True
                    no_local.add(e.worker_id)
                    self._handed_back_by = e.worker_id
                    if self._metrics is not None:
                        self._metrics.handed_back.inc()
                    tracing.rerun("handed_back", str(e))
                except WorkerFailure as e:
                    if e.refused_by is not None:
                        self._choice.worker_refused(e.refused_by)
                    failures += 1
                    if failures == MAX_ATTEMPTS:
                        raise
                    self._failed(attempt, e)
                    # A live attempt fails with its source's pages: the source is to blame.
                    avoid.add(self._live_from or e.worker_id)
                finally:
                    self._cluster.untrack(attempt)
                    attempt.close()
                    self._current = self.worker = None
                    self._live_from = ""
                if not moved:
                    await asyncio.sleep(rerun_backoff(failures - 1))
        finally:
            self._cluster.ended(self)
            if self._move is not None and not self._move.done.done():
                self._move.done.set_result(None)
            if self._gaps.longest is not None and self._metrics is not None:
                self._metrics.migration_stall.observe(self._gaps.longest)

    def _passed(self, output: TokenOut) -> None:
        self._passed_on.extend(output.token_ids)
        cutover = self._gaps.passed()
        if cutover is not None and self._metrics is not None:
            self._metrics.migration_cutover.observe(cutover)

    def _failed(self, attempt: Attempt, e: WorkerFailure) -> None:
        kind = "migration" if self._passed_on else "retry"
        log.warning(
            "request %s: %s; %s after %d tokens",
            attempt.request_id,
            e,
            kind,
            len(self._passed_on),
        )
        metrics = self._metrics
        if metrics is not None:
            metrics.reruns.labels(kind).inc()
            if kind == "migration":
                metrics.migrations.labels("recompute", "worker_failed").inc()
        if kind == "migration":
            self._gaps.migrated(bool(self._passed_on), self.request.arrival)
        tracing.rerun(kind, str(e))

    def _moving(self, avoid: set[str]) -> WorkerHandle | None:
        """The pending move's target, if it still serves (else placed as usual, away from
        the move's source)."""
        move = self._move
        if move is None:
            return None
        target = self._pool.get(move.target.worker_id)
        if target is not move.target or target not in self._pool.workers(target.role):
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
        self._gaps.migrated(bool(self._passed_on), self.request.arrival)
        if self._metrics is not None:
            layout, tokens = target.info.layout, len(request.input_ids)
            token_bytes = bytes_per_token(layout)
            self._metrics.moved(
                kind, move.reason, tokens, token_bytes, layout.page_size, move.warmed
            )
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
        self, attempt: Attempt, request: EngineRequest, avoid: set[str], no_local: set[str]
    ) -> AsyncIterator[TokenOut]:
        placing = tracing.placing()
        target = self._moving(avoid)
        move = self._move
        if target is not None and move is not None and move.handed_off and move.room:
            source = self._pool.get(move.source)
            live = self._resumed(held_back=1)
            if source is not None and live is not None:
                tracing.placed(placing, None, target)
                self._begin()
                self.worker, self._live_from = target, source.worker_id
                self._took_over(target, live, "live")
                peer = source.peer()
                async for output in single(self, attempt, live, target, move.room, peer):
                    yield output
                return
        placed, worker = await self._choice.place(
            request.input_ids, avoid, target, frozenset(no_local)
        )
        if placed is not None:
            placement, prefill, decode = placed
            tracing.placed(placing, placement, prefill, decode)
            self._begin(placement)
            self.worker = decode
            if placement.computes:  # on the worker computing it until its first token
                attempt.owe(prefill or decode, placement.computes)
            if prefill is None:  # local: D computes the prompt itself
                start_within = placement.start_within
                outputs = single(self, attempt, request, decode, start_within=start_within)
            else:
                outputs = pd(self, attempt, request, prefill, decode)
        else:
            assert worker is not None
            tracing.placed(placing, None, worker)
            self._begin()
            self.worker = worker
            outputs = single(self, attempt, request, worker)
        if self._move is not None:  # (on its target, or placed anew when that left)
            self._took_over(self.worker, request, "recompute")
        async for output in outputs:
            yield output

    def _begin(self, placement: Placement | None = None) -> None:
        self.timings = Timings(
            router_queue=time.monotonic() - self.request.arrival,
            handed_back_by=self._handed_back_by,
        )
        if placement is not None:
            self.timings.placement = placement.kind
            self.timings.placement_reason = placement.reason
            self.timings.predicted_ttft = placement.predicted_ttft

    def finished_on(self, worker: WorkerHandle, last: TokenOut) -> None:
        if worker.role == pb.DECODE:
            answer = self._passed_on + last.token_ids
            self._choice.remember(self.request.input_ids + answer, worker)

    def count_computed(self, answer: TokenOut) -> None:
        """The prompt tokens the placed worker computed (its cache held the others), by
        placement kind; `answer` is its last output."""
        metrics = self._metrics
        if metrics is not None and self.timings.placement:
            computed = max(0, answer.prompt_tokens - answer.cached_tokens)
            metrics.placement_prefill_tokens.labels(self.timings.placement).inc(computed)

    def received(self, response: TokenOut) -> TokenOut | None:
        """`response`, unless it carries neither tokens nor the finish."""
        # A resumed run's prompt includes earlier output: only the original prompt counts.
        cached = min(response.cached_tokens, len(self.request.input_ids))
        self.cached_tokens = max(self.cached_tokens, cached)
        if not response.token_ids and not response.finish_reason:
            return None
        return response


def rerun_backoff(reruns_before: int) -> float:
    """Seconds to wait before a rerun, after `reruns_before` earlier ones: jittered, so that
    the streams of one failed worker do not all come back in the same instant."""
    return RERUN_BACKOFF_S * 4**reruns_before * random.uniform(0.5, 1.0)
