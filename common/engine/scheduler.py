"""The scheduler: receive → schedule → launch → process, one loop for every mode.

Overlap: step N+1 is scheduled and launched before step N's results are processed;
step N's sampled tokens reach step N+1 through the model runner's future map. Without
overlap, the same functions run and a step's results are processed right after its
launch. A request that finishes in step N may ride along in step N+1; that extra token
is discarded.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from baton.common.cache.allocator import PageAllocator
from baton.common.cache.manager import CacheManager
from baton.common.cache.radix import RadixCache
from baton.common.config import EngineConfig, ModelConfig
from baton.common.engine.decode import DecodeManager, NeedSync
from baton.common.engine.model_runner import ModelRunner, StepInputs
from baton.common.engine.prefill import PrefillManager
from baton.common.engine.req import FinishReason, Req, ScheduledBatch, TokenLogprob
from baton.common.layers.sampler import SampleResult
from baton.common.sampling import SamplingParams

log = logging.getLogger(__name__)

# (request, new token ids, new logprobs, finished) -> None
OutputSink = Callable[[Req, list[int], list[TokenLogprob], bool], None]


@dataclass
class StepStats:
    running: int = 0
    queued: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    pages_in_use: int = 0
    tokens_this_step: int = 0
    prefix_hit_tokens: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative, at admission
    retracted: int = 0  # cumulative
    steps: int = 0


class SchedulerHooks:
    """Where a role changes the loop (the aggregated worker uses these defaults)."""

    decode_after_prefill = True

    def on_prefill_chunk(self, req: Req, computed: int, last: bool) -> None:
        """The KV of `req`'s first `computed` tokens is now in the pool."""

    def take_first_token(self, req: Req, reason: FinishReason | None) -> bool:
        """The first token was sampled; return True to take the request away."""
        return False

    def export_pages(self, req: Req, computed: int, last: bool) -> list[int]:
        """Pages a step completes that must be gathered for the KV transfer (TP only)."""
        return []


@dataclass
class _InFlight:
    batch: ScheduledBatch
    inputs: StepInputs
    result: Future[SampleResult]


class Scheduler:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, sink: OutputSink) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.sink = sink
        self.runner = ModelRunner(cfg, model_cfg)
        self.allocator = PageAllocator(cfg.num_pages - self.runner.reserved_pages)
        radix = None if cfg.disable_radix_cache else RadixCache(cfg.page_size, self.allocator.free)
        self.cache = CacheManager(cfg.page_size, self.allocator, self.runner.table, radix)
        chunk = cfg.chunked_prefill_size
        self.prefill = PrefillManager(
            self.cache,
            cfg.schedule_policy,
            chunk or cfg.max_prefill_tokens,
            chunk is not None,
            cfg.max_running_requests,
        )
        self.decode = DecodeManager(self.cache, cfg.decode_reserve_tokens)
        self.requests: dict[str, Req] = {}
        if self.runner.reserved_pages:
            self.runner.capture_cuda_graphs(scratch_row=self.runner.table.alloc())
        self.stats = StepStats()
        self._rng = random.Random(cfg.seed)
        self._pending: _InFlight | None = None
        self.hooks = SchedulerHooks()
        # TP with KV transfer: pages to scatter before / gather after the next step
        self.kv_import: list[int] = []
        self.kv_export: list[int] = []
        self._executor = None if cfg.disable_overlap else ThreadPoolExecutor(1, "baton-forward")

    # -- requests ----------------------------------------------------------------------
    def new_request(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> Req:
        """A validated request, not queued yet; an invalid one comes back finished."""
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        stop = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop.update(self.model_cfg.eos_token_ids)
        req = Req(rid, list(input_ids), sampling, seed, frozenset(stop))
        req.times["arrival"] = time.monotonic()
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already running")
        error = self._check(req)
        if error:
            req.error = error
            self.finish(req, FinishReason.ERROR)
        elif sampling.max_new_tokens == 0:
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

    def join_running(self, req: Req) -> None:
        """A request whose KV and first token came from elsewhere starts decoding here."""
        self.requests[req.rid] = req
        reason = self._stop_reason(req, req.output_ids[-1])
        if reason is not None:
            self.finish(req, reason)
        else:
            self.decode.add(req)

    def detach(self, req: Req) -> None:
        """Forget a request without releasing its memory (the caller releases it later)."""
        self.prefill.remove(req)
        self.decode.remove(req)
        self.requests.pop(req.rid, None)

    def _check(self, req: Req) -> str:
        n, ctx = len(req.input_ids), self.model_cfg.context_len
        if n == 0:
            return "the prompt is empty"
        if any(not 0 <= t < self.model_cfg.vocab_size for t in req.input_ids):
            return f"prompt token ids must be in [0, {self.model_cfg.vocab_size})"
        if n >= ctx:
            return f"the prompt has {n} tokens; the model's context length is {ctx}"
        if n + req.sampling.max_new_tokens > ctx:
            req.sampling = req.sampling.replace(max_new_tokens=ctx - n)
        need = -(-(n + req.sampling.max_new_tokens) // self.cfg.page_size)
        if need > self.cfg.num_pages:
            return (
                f"the request needs {n + req.sampling.max_new_tokens} tokens of KV cache; "
                f"the pool holds {self.cfg.max_total_tokens}"
            )
        return ""

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self.finish(req, FinishReason.ABORT)
        return True

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.times["finish"] = time.monotonic()
        self.prefill.remove(req)
        self.decode.remove(req)
        self.cache.release(req, cache=reason in (FinishReason.STOP, FinishReason.LENGTH))
        self.requests.pop(req.rid, None)
        self.sink(req, [], [], True)

    # -- the loop ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(len(self.prefill) or self.decode.running or self._pending)

    def step(self) -> None:
        try:
            batch = self._schedule()
        except NeedSync:
            self._process_pending()
            batch = self._schedule()
        launched = self._launch(batch) if batch is not None else None
        self._process_pending()
        self._pending = launched
        if self._executor is None:
            self._process_pending()

    def _schedule(self) -> ScheduledBatch | None:
        plan = self.prefill.schedule(len(self.decode.running), self.decode.reserved_pages())
        decodes: list[tuple[Req, list[int]]] = []
        if plan is None or self.cfg.enable_mixed_chunk:
            decodes, retracted = self.decode.schedule(self._pending is not None)
            for req in reversed(retracted):
                self.prefill.add(req, front=True)
        if plan is None and not decodes:
            return None
        sb = plan if plan is not None else ScheduledBatch([], [], [], [], [])
        for req, n, prefix, smp in zip(
            sb.reqs, sb.extend_lens, sb.prefix_lens, sb.sample, strict=True
        ):
            if smp and self.hooks.decode_after_prefill:
                self.decode.add(req)
            self.kv_export.extend(self.hooks.export_pages(req, prefix + n, smp))
        for req, slots in decodes:
            sb.reqs.append(req)
            sb.extend_lens.append(1)
            sb.prefix_lens.append(req.device_len - 1)
            sb.sample.append(True)
            sb.kv_slots.append(slots)
        return sb

    def _launch(self, sb: ScheduledBatch) -> _InFlight:
        inputs = self.runner.prepare(sb, self.cache.take_staged())
        inputs.kv_scatter, self.kv_import = self.kv_import, []
        inputs.kv_gather, self.kv_export = self.kv_export, []
        for req, smp in zip(sb.reqs, sb.sample, strict=True):
            if smp:
                req.in_flight += 1
        self.stats.steps += 1
        self.stats.tokens_this_step = sb.num_tokens
        if self._executor is not None:
            fut = self._executor.submit(self.runner.execute, inputs)
        else:
            fut = Future()
            fut.set_result(self.runner.execute(inputs))
        return _InFlight(sb, inputs, fut)

    def _process_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        result = pending.result.result()
        tokens = result.tokens.tolist()
        want_lp = result.logprobs is not None
        lps = result.logprobs.tolist() if want_lp and result.logprobs is not None else []
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        j = 0
        for req, smp, prefix, n in zip(
            pending.batch.reqs,
            pending.batch.sample,
            pending.batch.prefix_lens,
            pending.batch.extend_lens,
            strict=True,
        ):
            if prefix + n <= len(req.input_ids) and not req.finished:
                self.hooks.on_prefill_chunk(req, prefix + n, last=smp)
            if not smp:
                continue
            i, j = j, j + 1
            req.in_flight -= 1
            if req.finished:
                continue  # finished or aborted while this step was in flight
            tok = tokens[i]
            req.output_ids.append(tok)
            new_lp: list[TokenLogprob] = []
            if req.sampling.logprobs and want_lp:
                k = req.sampling.top_logprobs
                top = (
                    []
                    if top_ids is None or top_lps is None or k == 0
                    else list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                )
                new_lp = [TokenLogprob(tok, lps[i], top)]
                req.logprobs.extend(new_lp)
            if len(req.output_ids) == 1:
                req.times["first_token"] = time.monotonic()
            reason = self._stop_reason(req, tok)
            if len(req.output_ids) == 1 and self.hooks.take_first_token(req, reason):
                continue
            self.sink(req, [tok], new_lp, False)
            if reason is not None:
                self.finish(req, reason)

    def _stop_reason(self, req: Req, tok: int) -> FinishReason | None:
        n = len(req.output_ids)
        if tok in req.stop_ids and n >= req.sampling.min_new_tokens:
            return FinishReason.STOP
        if n >= req.sampling.max_new_tokens:
            return FinishReason.LENGTH
        if len(req.input_ids) + n >= self.model_cfg.context_len:
            return FinishReason.LENGTH
        return None

    # -- introspection -----------------------------------------------------------------
    def step_stats(self) -> StepStats:
        s = self.stats
        s.running = len(self.decode.running)
        s.queued = len(self.prefill)
        s.pages_free = self.allocator.num_free
        s.pages_cached = self.cache.radix.total_pages if self.cache.radix is not None else 0
        s.pages_in_use = self.cache.pages_in_use()
        s.retracted = self.decode.num_retracted
        s.prefix_hit_tokens = self.prefill.hit_tokens
        s.prompt_tokens = self.prefill.admitted_tokens
        return dataclasses.replace(s)

    def check_integrity(self) -> None:
        live = [r for r in self.requests.values() if r.slot is not None]
        self.cache.check_integrity(live)
        self.runner.pool.check_integrity()

    def drain(self) -> None:
        while self.has_work():
            self.step()

    def shutdown(self) -> None:
        if self._pending is not None:
            self._pending.result.result()
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.runner.shutdown()
