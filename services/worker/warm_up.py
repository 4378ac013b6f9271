"""A worker's warm-up: every kind of step it will meet, run once before it reports ready.

Kernels that compile on their first use compile here rather than in the first users'
TTFT. On a fresh 4-GPU H200 machine, with only a lone prompt warmed up, the first requests
with a cached prefix waited 44 s while flashinfer compiled its paged prefill kernel: TTFT
p50 40.7 s at 16 req/s (results/gpu_2026-11-27_s19). The waves, each run to its end before
the next starts:

- a prompt alone (flashinfer's single-prompt kernel), then a decode step;
- a prompt whose first tokens the first wave left in the prefix cache (the paged prefill
  kernel: also every step that mixes decode rows with a prompt);
- two prompts in one step (the ragged prefill kernel), 1,024 and 1,025 tokens in all;
- sampled requests: temperature alone, top-p with top-k, min-p, penalties, logprobs,
  each alone, in pairs, then all together (the sampler's kernels and each draw-graph
  variant's);
- more requests decoding at once than the largest decode graph holds (the eager decode
  kernels), where the worker admits that many;
- a prompt arriving while 1, 2, 4, 8, 16 and 17 requests decode, one of them with 2,048
  tokens of context (`mixed_waves`): where the worker mixes them into one step
  (`--enable-mixed-chunk`, or a decode worker computing a prompt itself) its decode rows
  attend eagerly on the decode kernel, whose split count (a specialization) follows their
  count and context, and the last layer's eager tail runs on that many rows and one more.
  An agg1
  cluster with mixed chunks stalled for seconds in its first requests without them
  (results/gpu_2026-11-29_s30: TTFT 3-6 s in the first 6 s, nothing logged).

A prefill worker never decodes: there every request ends at its first token. Its role takes
each of its own requests at that token (`first_token`); a warm-up request, which has no
room, it does not take, and one that went on past its first token would wait forever for a
decode step, holding its pages (a 1P1D cluster on GPUs never went idle: P kept 2 pages).

It leaves no trace: no request, no output, no page in use or cached; a warm-up that would
leave one fails the worker's start rather than serve with pages it can never free.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from baton.common.engine.step_clock import StepClock
from baton.common.sampling import SamplingParams

if TYPE_CHECKING:
    from baton.common.engine.scheduler import Scheduler

log = logging.getLogger("baton.scheduler")

PROMPT = 64  # tokens of a warm-up prompt
LONG = 512  # tokens of each of two prompts in one step
SLOW_WAVE_S = 5.0  # a wave this long compiled kernels: say so while it happens
# decode rows beside a prompt: the decode kernel's split count follows the row count
# (1 row: 16 splits, 17: 1 on an H200's 132 SMs with 8 KV heads), Triton specializes on
# % 16 and 1
MIXED_ROWS = (1, 2, 4, 8, 16, 17)
LONG_CONTEXT = 2048  # keys of one decoding row: no split count is capped by short contexts
MAX_STEPS_TO_DECODE = 64  # (a bound: a wave's prompts need one step each at most)
Wave = list[tuple[list[int], SamplingParams]]


class Outputs(Protocol):
    """What the warm-up needs of the scheduler's output sink (the scheduler process's
    `OutputCollector`): to take a wave's outputs, which no one reads."""

    def take(self) -> object: ...


def warm_up(scheduler: Scheduler, collector: Outputs) -> None:
    start, steps, mixed = time.monotonic(), scheduler.stats.steps, scheduler.stats.mixed_steps
    all_waves: list[tuple[Wave, Wave]] = [(wave, []) for wave in waves(scheduler)]
    all_waves += mixed_waves(scheduler)
    log.info(
        "warming up: %d waves of requests (kernels not yet cached compile now: "
        "a minute or more on a fresh machine)",
        len(all_waves),
    )
    scheduler.warming = True
    try:
        _run(scheduler, collector, all_waves)
    finally:
        scheduler.warming = False
    scheduler.cache.drop_unlocked()
    left, allocator = sorted(scheduler.requests), scheduler.allocator
    if left or allocator.num_free != allocator.num_pages:
        raise RuntimeError(
            f"the warm-up left {allocator.num_pages - allocator.num_free} pages held and "
            f"requests {left[:8]}"
        )
    log.info(
        "warmed up: %d waves, %d steps (%d of them prompt tokens beside decode rows) in %.1f s",
        len(all_waves),
        scheduler.stats.steps - steps,
        scheduler.stats.mixed_steps - mixed,
        time.monotonic() - start,
    )
    # Warm-up steps compile kernels: their times are no measure of the worker's steps (a
    # decode worker bounds its own prompt steps by them).
    scheduler.clock = StepClock()


def _run(scheduler: Scheduler, collector: Outputs, all_waves: list[tuple[Wave, Wave]]) -> None:
    for n, (wave, joining) in enumerate(all_waves):
        began = time.monotonic()
        reqs = [
            scheduler.add_request(f"baton-warmup-{n}-{i}", ids, sampling)
            for i, (ids, sampling) in enumerate(wave)
        ]
        if joining:  # once the wave decodes, the joining requests arrive beside it
            for _ in range(MAX_STEPS_TO_DECODE):
                if all(r.output_ids or r.finished for r in reqs):
                    break
                scheduler.step()
            for i, (ids, sampling) in enumerate(joining):
                scheduler.add_request(f"baton-warmup-{n}-j{i}", ids, sampling)
        scheduler.drain()
        collector.take()
        if (took := time.monotonic() - began) > SLOW_WAVE_S:
            log.info("warm-up wave %d of %d took %.1f s", n + 1, len(all_waves), took)


def waves(scheduler: Scheduler) -> list[Wave]:
    vocab = scheduler.model_cfg.vocab_size

    def ids(start: int, n: int) -> list[int]:  # distinct prompts, inside any vocabulary
        return [1 + (start + i) % (vocab - 1) for i in range(n)]

    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    first = ids(0, PROMPT)
    out: list[Wave] = [
        [(first, greedy)],
        [(first + ids(5 * PROMPT, PROMPT // 2 + 1), greedy)],
        # Triton kernels specialize on a row count's divisibility by 16, and the fused
        # gate/up kernel runs from FUSED_MIN_ROWS (1,024) rows: 1,024 and 1,025 rows
        [(ids(PROMPT, LONG), greedy), (ids(2 * PROMPT, LONG), greedy)],
        [(ids(3 * PROMPT, LONG), greedy), (ids(4 * PROMPT, LONG + 1), greedy)],
    ]
    # each kind of sampled row alone and in pairs (the draw kernels specialize on how
    # their per-row columns are aligned, which the batch's parity decides), then all kinds
    # in one step
    start = 6 * PROMPT
    for kinds in [*([k] for k in SAMPLED), *([k, k] for k in SAMPLED), SAMPLED]:
        out.append(
            [
                (ids(start + i, PROMPT // 4), SamplingParams(max_new_tokens=3, seed=i, **k))
                for i, k in enumerate(kinds)
            ]
        )
        start += len(kinds)
    if not scheduler.hooks.decodes_locally:  # a prefill worker: see the module docstring
        return [[(p, s.replace(max_new_tokens=1)) for p, s in wave] for wave in out]
    size = eager_decode_size(scheduler)
    if size:
        out.append([(ids(start + 4 * i, 4), greedy) for i in range(size)])
    return out


def mixed_waves(scheduler: Scheduler) -> list[tuple[Wave, Wave]]:
    """(requests that decode, a prompt that arrives once they do) for each count of
    `MIXED_ROWS` the worker admits beside the prompt; none where the worker never decodes.
    The first decoding request of each is the same long prompt (cached after the first)."""
    if not scheduler.hooks.decodes_locally:
        return []
    vocab = scheduler.model_cfg.vocab_size
    pool = scheduler.allocator.num_pages * scheduler.cfg.page_size
    long = min(LONG_CONTEXT, pool // 8, scheduler.model_cfg.context_len - 16)
    decoding = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)

    def ids(start: int, n: int) -> list[int]:
        return [1 + (start + j) % (vocab - 1) for j in range(n)]

    start = 10 * PROMPT  # past the other waves' prompts: no prefix hits between them
    first = ids(start, long)
    start += long
    out: list[tuple[Wave, Wave]] = []
    for rows in MIXED_ROWS:
        if rows >= scheduler.cfg.max_running_requests:
            break
        wave = [(first, decoding)]
        wave += [(ids(start + PROMPT * i, PROMPT // 4), decoding) for i in range(rows - 1)]
        start += PROMPT * rows
        out.append((wave, [(ids(start, PROMPT), greedy)]))
        start += PROMPT
    return out


SAMPLED: list[dict] = [
    {"temperature": 0.7},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.5},
    {"temperature": 0.0, "logprobs": True, "top_logprobs": 2},
]


def eager_decode_size(scheduler: Scheduler) -> int:
    """Requests that make a decode step too large for every graph, if the worker admits
    that many and they fit in a tenth of its pages; else 0."""
    graphs = scheduler.runner.graphs
    if graphs is None or scheduler.cfg.max_running_requests <= graphs.max_bs:
        return 0
    size = graphs.max_bs + 1
    pages = -(-6 // scheduler.cfg.page_size)  # 4 prompt tokens and 2 new, in whole pages
    return size if size * pages <= scheduler.allocator.num_pages // 10 else 0
