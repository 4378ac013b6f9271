"""Turn logits into tokens: grammar masks, penalties, logit bias, temperature,
top-k/top-p/min-p, seeded sampling.

Batch invariance: a sampled request draws its randomness from its own generator,
seeded by (request seed, output position), so the same seed gives the same tokens
alone or inside any batch, with overlap on or off, before or after a retraction.
Penalty state (token counts) lives on the device next to the logits and is updated
right after sampling, so it never waits for the host.

No host synchronization: `sample` never reads a device value on the host, and the step's
per-row settings reach the device in one asynchronous copy per dtype (`to_device`), so
sampling is queued behind the forward pass without waiting for it. A batch of plain
greedy rows is one argmax (`argmax.argmax_rows`, two small kernels on CUDA). On CUDA the
rows that draw take `draw.draw` (no sort, one launch for all rows' noise); elsewhere torch
sorts for top-p and draws each row's noise from a generator of its own. Both keep a row's
token a function of its logits, settings, seed and position alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.devices import to_device
from baton.common.layers import penalties
from baton.common.layers.argmax import argmax_rows
from baton.common.layers.draw import Filters, draw
from baton.common.layers.grammar import apply_bitmask
from baton.common.layers.kernels import use_triton
from baton.common.layers.penalties import PenaltyState
from baton.common.sampling import SamplingParams
from baton.common.state import Req

_MIX = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    return (seed * 6364136223846793005 + (position + 1) * _MIX) % (2**63)


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # index of the output token being sampled
    block_stop: list[int]  # token ids masked because min_new_tokens is not reached
    penalty: PenaltyState | None

    @classmethod
    def of(cls, req: Req, vocab: int, device: torch.device) -> SamplingRow:
        """The row of `req`'s next token; its penalty statistics made the first time."""
        p = req.sampling
        if p.uses_penalties and req.penalty is None:
            prompt_len = len(req.input_ids) - p.output_offset  # a resumed request's output
            req.penalty = PenaltyState(
                req.input_ids[:prompt_len],
                req.input_ids[prompt_len:] + req.output_ids,
                vocab,
                device,
            )
        block = []
        if req.output_len < p.min_new_tokens and req.grammar is None:  # a grammar decides
            block = sorted(req.stop_ids)
        return cls(p, req.seed, p.output_offset + req.output_len, block, req.penalty)

    @property
    def plain(self) -> bool:
        """Nothing to apply or report but its filters: its token is a function of its
        logits, temperature, top-k/top-p/min-p and seed alone."""
        p = self.params
        return self.penalty is None and not p.logit_bias and not self.block_stop and not p.logprobs

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply or report first: its token is the argmax."""
        return self.params.greedy and self.plain


@dataclass
class PromptLogprobs:
    """Log-softmax at prompt positions: each row's logprob of the prompt's next token."""

    logprobs: torch.Tensor  # [P]
    top_ids: torch.Tensor | None  # [P, K]
    top_logprobs: torch.Tensor | None  # [P, K]


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] logprob of the chosen token
    top_ids: torch.Tensor | None  # [B, K]
    top_logprobs: torch.Tensor | None  # [B, K]
    prompt: PromptLogprobs | None = None
    ready: torch.cuda.Event | None = None  # set by to_host: the host copies have landed

    def to_host(self) -> None:
        """On CUDA, start copying every value into pinned host memory behind the step and
        record `ready` after the copies. A reader waits for that event alone (`wait`).
        Reading a device tensor instead (`tolist`) synchronizes the whole stream, so it
        would also wait for the next step, which the forward thread may already have
        queued behind this one: the GPU would run dry before the host prepared the step
        after that."""
        on_cuda = self.tokens.device.type == "cuda"
        self.tokens = _host(self.tokens)  # the copies are no-ops for CPU tensors
        self.logprobs = _maybe_host(self.logprobs)
        self.top_ids = _maybe_host(self.top_ids)
        self.top_logprobs = _maybe_host(self.top_logprobs)
        if self.prompt is not None:
            p = self.prompt
            self.prompt = PromptLogprobs(
                _host(p.logprobs), _maybe_host(p.top_ids), _maybe_host(p.top_logprobs)
            )
        if on_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self) -> None:
        """Block until the values are on the host (no-op off CUDA)."""
        if self.ready is not None:
            self.ready.synchronize()


def _host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned host memory (torch pins a non-blocking D2H copy)."""
    return t.to("cpu", non_blocking=True)


def _maybe_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _host(t)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """logits [P, V] at prompt positions, targets [P]: the token that follows each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    if k == 0:
        return PromptLogprobs(chosen, None, None)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return PromptLogprobs(chosen, top_ids, top_logprobs)


def plain_greedy(rows: list[SamplingRow], grammar_mask: torch.Tensor | None) -> bool:
    """Whether every row's token is its argmax, with nothing to apply or report first."""
    return grammar_mask is None and all(r.plain_greedy for r in rows)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_mask: torch.Tensor | None = None
) -> SampleResult:
    """logits: [B, V] float32, one row per entry of `rows`. `grammar_mask`: [B, ceil(V/32)]
    int32 bitmask of the tokens each row's grammar allows (all bits set: no grammar).
    Returned logprobs are the model's own, before any mask, bias or penalty."""
    if plain_greedy(rows, grammar_mask):
        return SampleResult(argmax_rows(logits), None, None, None)
    want_logprobs = any(r.params.logprobs for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if grammar_mask is not None or any(
        r.penalty is not None or r.params.logit_bias or r.block_stop for r in rows
    ):
        logits = logits.clone()  # edited below; the caller's stay the model's
    knobs = _Knobs.of(rows, logits.device)
    if grammar_mask is not None:
        apply_bitmask(logits, grammar_mask)
    if knobs.penalty_list:
        _apply_penalties(logits, knobs)
    if knobs.bias_rows.numel():
        logits[knobs.bias_rows, knobs.bias_ids] += knobs.bias_values
    if knobs.block_rows.numel():
        banned = logits.new_full((), float("-inf"))  # a device value: see PenaltyState
        logits.index_put_((knobs.block_rows, knobs.block_ids), banned)
    on_gpu = use_triton(logits)
    if on_gpu and len(knobs.sampled_list) == len(rows):  # every row draws
        tokens = draw(logits, knobs.filters)
    else:
        tokens = argmax_rows(logits)
        if knobs.sampled.numel():
            if on_gpu:  # no sort, no launch per row (`draw`)
                tokens[knobs.sampled] = draw(logits[knobs.sampled], knobs.filters)
            else:
                tokens[knobs.sampled] = _race(logits[knobs.sampled], knobs, rows)
    if knobs.penalty_list and on_gpu:
        penalties.count(tokens, knobs.penalty_rows, knobs.seen_at, knobs.counts_at)
    else:
        for i, state in zip(knobs.penalty_list, knobs.penalty_states, strict=True):
            state.add(tokens[i])
    result = SampleResult(tokens, None, None, None)
    if raw_logprobs is not None:
        result.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        k = max(r.params.top_logprobs for r in rows)
        if k > 0:
            result.top_logprobs, result.top_ids = raw_logprobs.topk(k, dim=-1)
    return result


def _race(logits: torch.Tensor, knobs: _Knobs, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampled rows' tokens in torch (off CUDA): the filtered probabilities sorted for
    top-p, each row's noise from a generator of its own."""
    probs = _filtered_probs(logits, knobs.filters)
    noise = torch.empty_like(probs)
    for j, i in enumerate(knobs.sampled_list):
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(position_seed(rows[i].seed, rows[i].position))
        noise[j].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)  # exponential race == a draw


def _apply_penalties(logits: torch.Tensor, knobs: _Knobs) -> None:
    """The penalized rows' repetition, frequency and presence penalties: one kernel on CUDA
    (`penalties.penalize`), elsewhere a few ops over their token statistics stacked
    together (a penalty of 1 or 0 changes nothing)."""
    if use_triton(logits):
        penalties.penalize(
            logits,
            knobs.penalty_rows,
            knobs.seen_at,
            knobs.counts_at,
            (knobs.repetition, knobs.frequency, knobs.presence),
        )
        return
    seen = torch.stack([st.seen for st in knobs.penalty_states])
    counts = torch.stack([st.counts for st in knobs.penalty_states])
    x = logits[knobs.penalty_rows]
    rep = knobs.repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= knobs.frequency[:, None] * counts + knobs.presence[:, None] * (counts > 0)
    logits[knobs.penalty_rows] = x


@dataclass
class _Knobs:
    """The step's per-row settings on the device, uploaded together; the host keeps what
    decides which kernels run, so nothing is read back."""

    bias_rows: torch.Tensor  # logit_bias entries: (row, token id, value)
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    block_rows: torch.Tensor  # stop tokens masked before min_new_tokens: (row, token id)
    block_ids: torch.Tensor
    sampled: torch.Tensor  # [S] rows that draw (not greedy), and their filters and seeds
    filters: Filters
    sampled_list: list[int]
    penalty_rows: torch.Tensor  # [P] rows with penalties, and each one's three penalties
    penalty_list: list[int]
    penalty_states: list[PenaltyState]
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    seen_at: torch.Tensor  # [P] the address of each one's statistics (`penalties`)
    counts_at: torch.Tensor

    @classmethod
    def of(cls, rows: list[SamplingRow], device: torch.device) -> _Knobs:
        bias_rows, bias_ids, bias_values = [], [], []
        block_rows, block_ids = [], []
        for i, r in enumerate(rows):
            bias_rows += [i] * len(r.params.logit_bias)
            bias_ids += list(r.params.logit_bias)
            bias_values += list(r.params.logit_bias.values())
            block_rows += [i] * len(r.block_stop)
            block_ids += r.block_stop
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        params = [rows[i].params for i in sampled]
        top_k = [p.top_k for p in params]
        seeds = [position_seed(rows[i].seed, rows[i].position) for i in sampled]
        penalized = [i for i, r in enumerate(rows) if r.penalty is not None]
        penalty_params = [rows[i].params for i in penalized]
        states = [r.penalty for r in rows if r.penalty is not None]  # rows[i] for penalized
        seen_at = [st.seen.data_ptr() for st in states]
        counts_at = [st.counts.data_ptr() for st in states]
        ints = to_device(
            [
                *(bias_rows, bias_ids, block_rows, block_ids),
                *(sampled, top_k, seeds),
                *(penalized, seen_at, counts_at),
            ],
            device,
        )
        floats = to_device(
            [
                bias_values,
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.repetition_penalty for p in penalty_params],
                [p.frequency_penalty for p in penalty_params],
                [p.presence_penalty for p in penalty_params],
            ],
            device,
            torch.float32,
        )
        return cls(
            bias_rows=ints[0],
            bias_ids=ints[1],
            bias_values=floats[0],
            block_rows=ints[2],
            block_ids=ints[3],
            sampled=ints[4],
            filters=Filters(
                temperature=floats[1],
                top_k=ints[5],
                top_p=floats[2],
                min_p=floats[3],
                seed=ints[6],
                k_max=max([k for k in top_k if k > 0], default=0),
                any_top_p=any(p.top_p < 1 for p in params),
                any_min_p=any(p.min_p > 0 for p in params),
            ),
            sampled_list=sampled,
            penalty_rows=ints[7],
            penalty_list=penalized,
            penalty_states=states,
            repetition=floats[4],
            frequency=floats[5],
            presence=floats[6],
            seen_at=ints[8],
            counts_at=ints[9],
        )


def _filtered_probs(logits: torch.Tensor, knobs: Filters) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, for the sampled rows' logits."""
    probs = torch.softmax(logits / knobs.temperature[:, None], dim=-1)
    if knobs.k_max:
        kth = probs.topk(min(knobs.k_max, probs.shape[-1]), dim=-1).values
        on = knobs.top_k > 0
        ks = torch.where(on, knobs.top_k, knobs.k_max)
        thresh = kth.gather(1, (ks.clamp(max=kth.shape[1]) - 1)[:, None])
        probs = torch.where(~on[:, None] | (probs >= thresh), probs, 0.0)
    if knobs.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) > knobs.top_p[:, None] * cum[:, -1:]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if knobs.any_min_p:
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < knobs.min_p[:, None] * peak, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
