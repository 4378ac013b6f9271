"""The scheduler: receive → schedule → launch → process, one loop for every mode and role.

Overlap: step N+1 is scheduled and launched before step N's results are processed;
step N's sampled tokens reach step N+1 through the model runner's future map. Without
overlap, the same functions run and a step's results are processed right after its
launch. A request that finishes in step N may ride along in step N+1; that extra token
is discarded. A request that comes while step N runs is taken after it, when N+1 is
launched already: it is computed in N+2 at the earliest, unless N was longer than
`overlap_max_step_tokens` (then processed before N+1 is scheduled).

Roles change the loop only through `SchedulerHooks` (given at construction) and drive it
only through the methods of `SchedulerPort` (see `seam`).

Structured output: a request's grammar masks its next token, so its previous token must
be processed before it is scheduled again; with overlap, a step holding such a request is
processed before the next is scheduled (`_grammar_waits`), which keeps outputs identical
with overlap on or off.

A failed step fails no innocent request (`recovery`): the requests of the failed steps
give their memory back and are recomputed one at a time; the one whose step fails alone
gets the error.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.manager import CacheManager, HeldMemory
from baton.common.cache.tiered_radix import prefix_cache
from baton.common.config import EngineConfig, ModelConfig
from baton.common.engine.admission import Admission
from baton.common.engine.decode import DecodeManager, NeedSync
from baton.common.engine.intake import Intake
from baton.common.engine.model_runner import ModelRunner
from baton.common.engine.outputs import OutputSink, StepOutputs, stop_reason
from baton.common.engine.prefill import PrefillManager
from baton.common.engine.recovery import FatalEngineError, Recovery, abandon_in_flight
from baton.common.engine.seam import SchedulerHooks
from baton.common.engine.stats import StepStats, collect_stats
from baton.common.engine.step import InFlight
from baton.common.engine.step_clock import SlowStep, StepBudget, StepClock
from baton.common.ratelog import RateLimitedLog
from baton.common.sampling import SamplingParams
from baton.common.state import FinishReason, Req, ScheduledBatch
from baton.common.step_times import chunk_pairs

__all__ = ["FatalEngineError", "OutputSink", "Scheduler"]

_stalls = RateLimitedLog(logging.getLogger("baton.scheduler"))


def _log_stall(slow: SlowStep, pending: InFlight, waited: float) -> None:
    """Where a stalled step's time went: the forward thread queueing its kernels (a kernel
    compiled on first use, a collection), the scheduler waiting for its results (the
    device), or neither (the scheduler thread busy elsewhere while it ran)."""
    _stalls.warning(
        "a step of %d tokens over %d requests (longest context %d, %s) took %.2f s where "
        "this worker's steps predict %.3f s: every running stream waited (%.2f s of it "
        "queueing its kernels on the host, %.2f s waiting for the device, the rest the "
        "scheduler busy elsewhere)",
        slow.tokens,
        slow.rows,
        max((it.prefix_len + it.extend_len for it in pending.batch.items), default=0),
        pending.step.ran or "no forward",
        slow.seconds,
        slow.predicted,
        pending.step.host_seconds,
        min(waited, slow.seconds),
    )


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        sink: OutputSink,
        *,
        runner: ModelRunner | None = None,
        hooks: SchedulerHooks | None = None,
    ) -> None:
        self.model_cfg = model_cfg
        self.runner = runner if runner is not None else ModelRunner(cfg, model_cfg)
        self.cfg = cfg = self.runner.cfg  # the KV pool's size resolved
        self.hooks = hooks if hooks is not None else SchedulerHooks()
        self.allocator = PageAllocator(cfg.num_pages - self.runner.reserved_pages)
        radix = None
        if not cfg.disable_radix_cache:
            host_pages = cfg.host_kv_tokens // cfg.page_size
            write_through = cfg.host_kv_write == "through"
            radix = prefix_cache(
                cfg.page_size, self.allocator.free, self.runner.pool, host_pages, write_through
            )
        self.cache = CacheManager(cfg.page_size, self.allocator, self.runner.table, radix)
        self.decode = DecodeManager(self.cache, cfg.decode_reserve_tokens, self.hooks.keep_memory)
        self.admission = Admission(self.cache, self.decode, cfg.max_running_requests)
        chunk = cfg.chunked_prefill_size
        self.prefill = PrefillManager(
            self.cache,
            self.admission,
            cfg.schedule_policy,
            chunk or cfg.max_prefill_tokens,
            chunk is not None,
        )
        self.requests: dict[str, Req] = {}
        self.intake = Intake(model_cfg, cfg.page_size, self.allocator.num_pages, cfg.seed)
        if self.runner.reserved_pages:
            self.runner.capture_cuda_graphs(scratch_row=self.runner.table.alloc())
        self.stats = StepStats()
        self.clock = StepClock()
        # the warm-up runs: a role's prompt budget (its SLO's slack) does not bound its
        # steps, whose times are kernel compiles; their shapes are what it is for
        self.warming = False
        self._pending: InFlight | None = None
        self._launching: ScheduledBatch | None = None  # being built, not yet pending
        self._launched: InFlight | None = None  # launched, not yet pending
        self.recovery = Recovery(
            self.cache,
            self.prefill,
            self.decode,
            self.requests,
            self.hooks.keep_memory,
            self.finish,
            self.runner.check_device,
        )
        self.outputs = StepOutputs(
            sink, self.hooks, self.recovery, self.finish, self.forget, model_cfg.context_len
        )
        self._executor = None if cfg.disable_overlap else ThreadPoolExecutor(1, "baton-forward")

    @property
    def sink(self) -> OutputSink:
        """Where every request's outputs go (`StepOutputs` emits them)."""
        return self.outputs.sink

    @sink.setter
    def sink(self, sink: OutputSink) -> None:
        self.outputs.sink = sink

    def set_hooks(self, hooks: SchedulerHooks) -> None:
        """Plug in another role's hooks (the worker changes role in place); only while
        the scheduler holds no request, since every request belongs to the old role."""
        if self.requests or self.has_work():
            raise RuntimeError("the scheduler still holds requests; its role cannot change")
        self.hooks = self.outputs.hooks = hooks
        self.recovery.keep_memory = self.decode.keep_memory = hooks.keep_memory

    # -- the port (see seam.SchedulerPort) ---------------------------------------------
    def new_request(
        self, rid: str, input_ids: list[int], sampling: SamplingParams, received_at: float = 0.0
    ) -> Req:
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already running")
        req = self.intake.make(rid, input_ids, sampling, received_at)
        if req.error:
            self.finish(req, FinishReason.ERROR)
        elif req.sampling.max_new_tokens == 0:
            self.finish(req, FinishReason.LENGTH)
        return req

    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> Req:
        req = self.new_request(rid, input_ids, sampling)
        if not req.finished:
            self.enqueue(req)
        return req

    def enqueue(self, req: Req) -> None:
        self.requests[req.rid] = req
        self.prefill.add(req)

    def reserve(self, req: Req) -> bool:
        """Admit a decode worker's room (its KV will arrive from P). Never ahead of a
        request here short of pages (retracted, or refused at admission): rooms arriving
        all the time would otherwise take every page it needs (starved for minutes on a GPU
        under 1.5x load, 2026-11-26). A local prompt waiting only for its running requests'
        TPOT slack does not hold rooms back: P's requests waited behind such prompts,
        their TTFT 1-2 s at 20 req/s where always-disagg's was 0.2 s (2x H200, s33)."""
        if self.prefill.short_of_memory():
            return False
        if not self.admission.try_admit(req, with_decode_reserve=True):
            return False
        self.cache.extend(req, req.num_tokens - req.device_len)
        if self.cache.has_page_moves():
            # P writes these pages itself, at once: copies that read pages freed to them
            # (or load its prefix) must be done first, after the step in flight (a request
            # that finished may still write its last page in it). Blocks the loop that long.
            if self._pending is not None:
                self._pending.result.exception()
            self.cache.run_page_moves()
        self.requests[req.rid] = req
        self.decode.reserve(req)
        return True

    def join_running(self, req: Req) -> None:
        self.requests[req.rid] = req
        self.cache.cache_prefix(req)
        if req.grammar is not None and not req.grammar.accept(req.output_ids[-1]):
            req.error = "the first token does not follow the grammar"
            self.finish(req, FinishReason.ERROR)
            return
        reason = stop_reason(req, req.output_ids[-1], self.model_cfg.context_len)
        if reason is not None:
            self.finish(req, reason)
        else:
            self.decode.add(req)

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.times["finish"] = time.monotonic()
        answered = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if answered and req.can_stop:
            # how long answers run (a resumed one's with what it made elsewhere)
            self.clock.answers.add(req.sampling.output_offset + len(req.output_ids))
        self.forget(req)
        self.cache.release(req, cache=answered)
        self.sink(req, [], [], True)

    def release(self, req: Req, cache: bool) -> None:
        self.cache.release(req, cache=cache)

    def take_memory(self, req: Req) -> HeldMemory | None:
        return self.cache.take(req) if req.slot is not None else None

    def release_held(self, held: HeldMemory) -> None:
        self.cache.release_held(held)

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self.finish(req, FinishReason.ABORT)
        return True

    def withdraw(self, rid: str, reason: FinishReason) -> bool:
        req = self.requests.get(rid)
        if req is None or req.device_len or req.output_ids or req not in self.prefill.waiting:
            return False  # (a finished request is in no queue)
        self.finish(req, reason)
        return True

    def fail_all(self, reason: str) -> None:
        for req in list(self.requests.values()):
            req.error = reason
            self.finish(req, FinishReason.ERROR)

    # -- requests ----------------------------------------------------------------------
    def forget(self, req: Req) -> None:
        """Take the request off the queues and the running set; its memory stays."""
        self.prefill.remove(req)
        self.decode.remove(req)
        self.requests.pop(req.rid, None)

    # -- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(len(self.prefill) or self.decode.running or self._pending)

    def step(self) -> None:
        try:
            self._step()
        except FatalEngineError:
            raise
        except Exception as exc:
            batches = abandon_in_flight((self._pending, self._launched), self._launching)
            self._pending = self._launched = self._launching = None  # forgotten
            self.recovery.step_failed(exc, batches)

    def _step(self) -> None:
        if self._pending is not None and self.prefill.next_is_suspect():
            self._process_pending()  # a suspect's step runs alone
        if self._grammar_waits():
            self._process_pending()
        try:
            batch = self._schedule()
        except NeedSync:
            self._process_pending()
            batch = self._schedule()
        self._launched = self._launch(batch) if batch is not None else None
        self._process_pending()
        self._pending, self._launched, self._launching = self._launched, None, None
        # a long step (overlap_max_step_tokens) too: what comes during it joins the next
        long = batch is not None and 0 < self.cfg.overlap_max_step_tokens < batch.num_tokens
        if self._executor is None or (batch is not None and batch.solo) or long:
            self._process_pending()

    def _grammar_waits(self) -> bool:
        """The pending step sampled for a request with a grammar: its next mask needs
        that token."""
        pending = self._pending
        return pending is not None and any(
            it.sample and it.req.grammar is not None and not it.req.finished
            for it in pending.batch.items
        )

    def _schedule(self) -> ScheduledBatch | None:
        plan = self._launching = ScheduledBatch()
        # A role may cap this step's prompt tokens (a decode worker computing a prompt of
        # its own keeps its TPOT); its running requests then decode in the same step.
        cap = self.hooks.prefill_budget(self.decode.running, self.clock)
        if cap is not None and self.warming:
            cap = StepBudget()
        if cap is not None:  # its running requests decode beside the prompt, in pieces
            cap.padded_sizes, cap.rows = self.runner.piecewise_sizes, len(self.decode.running)
        self.prefill.schedule(plan, cap)
        prefills = list(plan.items)
        if not plan.solo and (not prefills or self.cfg.enable_mixed_chunk or cap is not None):
            retracted = self.decode.schedule(plan, self._pending is not None)
            for req in reversed(retracted):
                self.prefill.add(req, front=True)
            if prefills and len(plan.items) > len(prefills):
                self.stats.mixed_steps += 1
        if self.hooks.decodes_locally:
            for item in prefills:
                if item.sample:  # decodes from the next step on (overlap: before this one ends)
                    self.decode.add(item.req)
        if not plan.items:
            self._launching = None
            return None
        return plan

    def _launch(self, sb: ScheduledBatch) -> InFlight:
        step = self.runner.prepare(sb, self.cache.take_staged())
        step.kv_scatter, step.kv_gather = self.hooks.kv_moves(sb)
        step.page_moves = self.cache.take_page_moves()
        step.wire = self.hooks.kv_wire
        for item in sb.items:
            if item.sample:
                item.req.in_flight += 1
            if item.req.trace is not None:
                item.req.trace.launched(item)
        self.stats.steps += 1
        self.stats.tokens_this_step = sb.num_tokens
        launched = time.perf_counter()  # (before a step run here: its time is its own)
        if self._executor is not None and self._pending is not None:
            fut = self._executor.submit(self.runner.execute, step)
        else:  # nothing in flight to overlap with: no hand-off to the forward thread's wake-up
            fut = Future()
            fut.set_result(self.runner.execute(step))
        return InFlight(sb, step, fut, launched)

    def _process_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
        waiting = time.perf_counter()
        result = pending.result.result()  # a failed step raises here, still pending
        self._pending = None
        # its end on the device: the forward thread returns once the kernels are queued, and
        # a step timed then leaves its device time to the step after it (a mixed step's to
        # the decode step that followed, on an H200)
        result.wait()
        waited = time.perf_counter() - waiting
        batch = pending.batch
        pairs = sum(chunk_pairs(it.extend_len, it.prefix_len) for it in batch.items)
        slow = self.clock.step_done(batch.num_tokens, len(batch.items), pending.launched, pairs)
        if slow is not None and not self.warming:  # (warm-up steps compile on purpose)
            self.stats.stalled_steps += 1
            _log_stall(slow, pending, waited)
        self.outputs.process(pending.batch, pending.step, result)

    # -- introspection -----------------------------------------------------------------
    def step_stats(self) -> StepStats:
        return collect_stats(
            self.stats,
            self.prefill,
            self.decode,
            self.cache,
            self.allocator,
            self.recovery.failed_steps,
            self.runner.graphs,
            self.runner.prefill_graphs,
            self.runner.piecewise_graphs,
            self.clock,
        )

    def check_integrity(self) -> None:
        live = [r for r in self.requests.values() if r.slot is not None]
        self.cache.check_integrity(live)
        self.runner.pool.check_integrity()

    def drain(self) -> None:
        while self.has_work():
            self.step()

    def shutdown(self) -> None:
        if self._pending is not None:
            self._pending.result.exception()
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.runner.shutdown()
