"""What a decode graph needs to draw a step's tokens inside it (`CudaGraphRunner.draw`):
which kind of draw graph the step takes, and its rows' settings as columns of the graph's
buffer, uploaded with the step's positions in one copy, and read back there.

A draw graph replaces `sampler.sample` for the steps whose rows only filter and draw:
temperature, top-k, top-p, min-p and a seed, beside greedy rows. Its tokens are the ones
`sample` draws (`draw.draw` on the same logits and settings; a row's token does not
depend on the batch around it), so a request gets the same tokens either way.

What it buys is host time, not GPU time. On an H200 (2026-11-27, s18 call 2) the forward
thread's host time per decode step (`execute`, median) at batch 1 fell from 2.15 to 1.00
ms with top-p, from 1.48 to 1.01 with top-k, from 1.12 to 0.80 at temperature 1; the
step itself moved by 0.02 ms at most, as the GPU was already busy through every step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from baton.common.layers.draw import Filters
from baton.common.layers.sampler import SamplingRow, position_seed

GRAPH_TOP_K = 1024  # the largest top_k a decode graph's draw takes


class DrawKind(NamedTuple):
    """What a decode graph's draw computes, fixed when it is captured: top-k over the
    `k_max` largest logits (a power of 4 from 16; 0: no row filters by top-k), and whether
    any row filters by top-p or min-p. Few kinds, so few graphs (`CudaGraphRunner.draw`)."""

    k_max: int
    top_p: bool
    min_p: bool


def graph_draw(rows: list[SamplingRow]) -> tuple[DrawKind, list[np.ndarray]] | None:
    """For a step whose rows are all plain and some draw: the kind of draw graph it takes,
    and its rows' settings as five int64 columns for the graph's buffer (a decode graph
    uploads them with the step's positions, in one copy): temperature (0: greedy), top-p
    and min-p as their float32 bits, top_k (0: off), the seed of the row's position. None
    where `sample` must run: a row with penalties, a logit bias, masked stop tokens or
    logprobs, or a top_k above `GRAPH_TOP_K`."""
    if not all(r.plain for r in rows) or all(r.params.greedy for r in rows):
        return None
    # columns, not a tuple a row: a step at batch 128 would leave 128 objects to the
    # collector (gen_0 ran every step, and now and then a gen_2 pass stalled the loop)
    drawn = [r.params for r in rows if not r.params.greedy]
    top_k = [0 if r.params.greedy else max(r.params.top_k, 0) for r in rows]
    k_max = max(top_k)
    if k_max > GRAPH_TOP_K:
        return None
    bucket = 16 if k_max else 0
    while bucket < k_max:
        bucket *= 4
    kind = DrawKind(bucket, any(p.top_p < 1 for p in drawn), any(p.min_p > 0 for p in drawn))
    floats = np.array(
        [
            [0.0 if r.params.greedy else r.params.temperature for r in rows],
            [1.0 if r.params.greedy else r.params.top_p for r in rows],
            [0.0 if r.params.greedy else r.params.min_p for r in rows],
        ],
        dtype=np.float32,
    )
    seeds = [0 if r.params.greedy else position_seed(r.seed, r.position) for r in rows]
    return kind, [
        *floats.view(np.int32).astype(np.int64),
        np.array(top_k, dtype=np.int64),
        np.array(seeds, dtype=np.int64),
    ]


def graph_filters(knobs: torch.Tensor, kind: DrawKind) -> tuple[torch.Tensor, Filters]:
    """`graph_draw`'s columns [5, B] on the device, back: which rows are greedy (their
    temperature is 0, as the padding rows' whose columns are all 0), and every row's
    filters for `draw`, greedy rows at temperature 1 without any."""
    temperature, top_p, min_p = knobs[:3].to(torch.int32).view(torch.float32)
    greedy = temperature == 0
    filters = Filters(
        temperature=torch.where(greedy, 1.0, temperature),
        top_k=knobs[3],
        top_p=torch.where(greedy, 1.0, top_p),
        min_p=min_p,
        seed=knobs[4],
        k_max=kind.k_max,
        any_top_p=kind.top_p,
        any_min_p=kind.min_p,
    )
    return greedy, filters
