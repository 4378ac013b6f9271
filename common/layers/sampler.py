"""Turn logits into tokens: grammar masks, penalties, logit bias, temperature,
top-k/top-p/min-p, seeded sampling.

Batch invariance: a sampled request draws its randomness from its own generator,
seeded by (request seed, output position), so the same seed gives the same tokens
alone or inside any batch, with overlap on or off, before or after a retraction.
Penalty state (token counts) lives on the device next to the logits and is updated
right after sampling, so it never waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.layers.grammar import apply_bitmask
from baton.common.sampling import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def position_seed(seed: int, position: int) -> int:
    return (seed * 6364136223846793005 + (position + 1) * _MIX) % (2**63)


class PenaltyState:
    """Device-side token statistics of one request (only for requests with penalties)."""

    def __init__(
        self, prompt: list[int], output: list[int], vocab: int, device: torch.device
    ) -> None:
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if prompt:
            self.seen[torch.tensor(prompt, device=device).clamp_(max=vocab - 1)] = True
        for t in output:
            self.add(torch.tensor(t, device=device))

    def add(self, token: torch.Tensor) -> None:
        self.seen[token] = True
        self.counts[token] += 1.0


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # index of the output token being sampled
    block_stop: list[int]  # token ids masked because min_new_tokens is not reached
    penalty: PenaltyState | None


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


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """logits [P, V] at prompt positions, targets [P]: the token that follows each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    if k == 0:
        return PromptLogprobs(chosen, None, None)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return PromptLogprobs(chosen, top_ids, top_logprobs)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], grammar_mask: torch.Tensor | None = None
) -> SampleResult:
    """logits: [B, V] float32, one row per entry of `rows`. `grammar_mask`: [B, ceil(V/32)]
    int32 bitmask of the tokens each row's grammar allows (all bits set: no grammar).
    Returned logprobs are the model's own, before any mask, bias or penalty."""
    want_logprobs = any(r.params.logprobs for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = logits.clone()
    if grammar_mask is not None:
        apply_bitmask(logits, grammar_mask)
    for i, r in enumerate(rows):
        if r.penalty is not None:
            _apply_penalties(logits[i], r.params, r.penalty)
        if r.params.logit_bias:
            bias = r.params.logit_bias
            ids = torch.tensor(list(bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device)
        if r.block_stop:
            logits[i, r.block_stop] = float("-inf")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        probs = _filtered_probs(logits[idx], [rows[i].params for i in sampled])
        for j, i in enumerate(sampled):
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(position_seed(rows[i].seed, rows[i].position))
            noise = torch.empty_like(probs[j]).exponential_(generator=gen)
            tokens[i] = (probs[j] / noise).argmax()  # exponential race == categorical draw
    for i, r in enumerate(rows):
        if r.penalty is not None:
            r.penalty.add(tokens[i])
    result = SampleResult(tokens, None, None, None)
    if raw_logprobs is not None:
        result.logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        k = max(r.params.top_logprobs for r in rows)
        if k > 0:
            result.top_logprobs, result.top_ids = raw_logprobs.topk(k, dim=-1)
    return result


def _apply_penalties(row: torch.Tensor, p: SamplingParams, state: PenaltyState) -> None:
    if p.repetition_penalty != 1.0:
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(state.seen, penalized, row))
    if p.frequency_penalty or p.presence_penalty:
        row -= p.frequency_penalty * state.counts + p.presence_penalty * (state.counts > 0)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        k_max = max(top_k)
        kth = probs.topk(min(k_max, probs.shape[-1]), dim=-1).values
        ks = torch.tensor([k if k > 0 else k_max for k in top_k], device=dev)
        thresh = kth.gather(1, (ks.clamp(max=kth.shape[1]) - 1)[:, None])
        keep_all = torch.tensor([k <= 0 for k in top_k], device=dev)[:, None]
        probs = torch.where(keep_all | (probs >= thresh), probs, 0.0)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) > top_p[:, None] * cum[:, -1:]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((min_p > 0).any()):
        peak = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * peak, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
