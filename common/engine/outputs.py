"""A step's results, request by request: what the scheduler does once a step's sampled
tokens reach the host.

    prompt chunk computed ──▶ the role hears of it (`hooks.chunk_computed`)
    token sampled         ──▶ appended with its logprobs ─▶ the grammar accepts it?
                          ──▶ stop reason ─▶ a first token: the role may take the request
                              (`hooks.first_token`) ─▶ any token: the role may take it
                              (`hooks.hand_off`: live migration) ─▶ the sink ─▶ finished?

Tokens of requests that finished while the step was in flight are dropped. An error
while one request's results are processed is that request's alone (`Recovery`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from baton.common.engine.step import Step
from baton.common.layers.sampler import PromptLogprobs, SampleResult
from baton.common.state import FinishReason, Req, ScheduledBatch, ScheduledItem, TokenLogprob

if TYPE_CHECKING:
    from baton.common.engine.recovery import Recovery
    from baton.common.engine.seam import SchedulerHooks

log = logging.getLogger(__name__)

# (request, new token ids, new logprobs, finished) -> None
OutputSink = Callable[[Req, list[int], list[TokenLogprob], bool], None]


def stop_reason(req: Req, tok: int, context_len: int) -> FinishReason | None:
    """Why the request stops after `tok`, its latest output token; None if it goes on."""
    n = len(req.output_ids)
    if tok in req.stop_ids and n >= req.sampling.min_new_tokens:
        return FinishReason.STOP
    if req.grammar is not None and req.grammar.terminated:
        return FinishReason.STOP  # the grammar is complete (and took a stop token)
    if n >= req.sampling.max_new_tokens:
        return FinishReason.LENGTH
    if len(req.input_ids) + n >= context_len:
        return FinishReason.LENGTH
    return None


class StepOutputs:
    """Owns the sink every output goes to. Ends requests through the scheduler's `finish`
    (memory released, final output emitted) and `forget` (a hand-off: memory kept)."""

    def __init__(
        self,
        sink: OutputSink,
        hooks: SchedulerHooks,
        recovery: Recovery,
        finish: Callable[[Req, FinishReason], None],
        forget: Callable[[Req], None],
        context_len: int,
    ) -> None:
        self.sink = sink
        self.hooks = hooks
        self.recovery = recovery
        self.finish = finish
        self.forget = forget
        self.context_len = context_len

    def process(self, batch: ScheduledBatch, step: Step, result: SampleResult) -> None:
        """The results of the step that ran `batch`, for each of its requests."""
        result.wait()  # this step's copies, not the step queued behind it
        tokens = result.tokens.tolist()
        want_lp = result.logprobs is not None
        lps = result.logprobs.tolist() if result.logprobs is not None else []
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        if result.prompt is not None:
            self._prompt_logprobs_done(step, result.prompt)
        j = 0
        for item in batch.items:
            req = item.req
            req.suspect = False
            if not item.sample:
                if item.end <= len(req.input_ids) and not req.finished:
                    self._guarded(req, self._chunk_done, item, step)
                continue
            i, j = j, j + 1
            req.in_flight -= 1
            if req.finished:
                continue  # finished or aborted while this step was in flight
            new_lp: list[TokenLogprob] = []
            if req.sampling.logprobs and want_lp:
                k = req.sampling.top_logprobs
                top = (
                    []
                    if top_ids is None or top_lps is None or k == 0
                    else list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                )
                new_lp = [TokenLogprob(tokens[i], lps[i], top)]
            self._guarded(req, self._token_done, item, step, tokens[i], new_lp)
        self.recovery.step_succeeded()

    def _prompt_logprobs_done(self, step: Step, prompt: PromptLogprobs) -> None:
        chosen = prompt.logprobs.tolist()
        top_ids = prompt.top_ids.tolist() if prompt.top_ids is not None else None
        top_lps = prompt.top_logprobs.tolist() if prompt.top_logprobs is not None else None
        row = 0
        for req, first, count in step.prompt_spans:
            k = req.sampling.prompt_logprobs or 0
            entries = []
            for i in range(row, row + count):
                top = []
                if k and top_ids is not None and top_lps is not None:
                    top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
                target = req.input_ids[first + 1 + i - row]
                entries.append(TokenLogprob(target, chosen[i], top))
            # by position: a chunk computed again (after a failed step) replaces its own
            req.prompt_logprobs[first:] = entries
            row += count

    def _guarded(self, req: Req, fn: Callable[..., None], *args: object) -> None:
        """Per-request processing: an error here is that request's alone."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("request %s failed while its step's results were processed", req.rid)
            self.recovery.request_failed(req, exc)

    def _chunk_done(self, item: ScheduledItem, step: Step) -> None:
        if item.req.trace is not None:
            item.req.trace.chunk_computed(item)
        self.hooks.chunk_computed(item.req, item.end, False, step.done)

    def _token_done(
        self, item: ScheduledItem, step: Step, tok: int, new_lp: list[TokenLogprob]
    ) -> None:
        req = item.req
        if item.end <= len(req.input_ids):
            if req.trace is not None:
                req.trace.chunk_computed(item)
            self.hooks.chunk_computed(req, item.end, True, step.done)
        req.output_ids.append(tok)
        req.logprobs.extend(new_lp)
        if req.grammar is not None and not req.grammar.accept(tok):
            req.error = f"token {tok} does not follow the grammar"
            self.finish(req, FinishReason.ERROR)
            return
        reason = stop_reason(req, tok, self.context_len)
        if len(req.output_ids) == 1:
            req.times["first_token"] = time.monotonic()
            if self.hooks.first_token(req, reason):
                self._hand_off(req, reason, tok, req.logprobs[:1])
                return
        if self.hooks.hand_off(req, reason, step.done):
            self._hand_off(req, FinishReason.MIGRATED, tok, new_lp)
            return
        self.sink(req, [tok], new_lp, False)
        if reason is not None:
            self.finish(req, reason)

    def _hand_off(
        self, req: Req, reason: FinishReason | None, tok: int, lps: list[TokenLogprob]
    ) -> None:
        """The role took the request: `tok` is its last output here."""
        self.forget(req)
        req.finish_reason = reason
        self.sink(req, [tok], lps, True)
