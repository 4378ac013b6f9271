"""What the scheduler reports about itself: `StepStats`, the counters behind a worker's
metrics and stats messages, and `collect_stats`, which reads them off the scheduler's parts
(queues, memory, recovery, CUDA graphs, step clock), each handed to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.common.engine.step_clock import StepClock
from baton.common.step_times import StepTimes

if TYPE_CHECKING:
    from baton.common.cache.allocator import PageAllocator
    from baton.common.cache.manager import CacheManager
    from baton.common.engine.cuda_graph import CudaGraphRunner
    from baton.common.engine.decode import DecodeManager
    from baton.common.engine.piecewise_graph import PiecewiseGraphRunner
    from baton.common.engine.prefill import PrefillManager
    from baton.common.engine.prefill_graph import PrefillGraphRunner


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
    failed_steps: int = 0  # cumulative
    decode_graph_steps: int = 0  # cumulative: steps replayed from a decode graph
    prompt_graph_steps: int = 0  # cumulative: from a prompt graph (engine/prefill_graph.py)
    piecewise_graph_steps: int = 0  # cumulative: in pieces (engine/piecewise_graph.py)
    draw_graph_steps: int = 0  # cumulative: decode steps that drew in a graph
    # cumulative: steps that computed prompt tokens beside running requests' decode rows
    # (--enable-mixed-chunk; a decode worker computing a prompt itself)
    mixed_steps: int = 0
    # cumulative: steps far past what the worker's own fit predicted (`StepClock.step_done`)
    stalled_steps: int = 0
    step_times: StepTimes = dataclasses.field(default_factory=StepTimes)  # cumulative


def collect_stats(
    stats: StepStats,
    prefill: PrefillManager,
    decode: DecodeManager,
    cache: CacheManager,
    allocator: PageAllocator,
    failed_steps: int,
    decode_graphs: CudaGraphRunner | None,
    prompt_graphs: PrefillGraphRunner | None,
    piecewise_graphs: PiecewiseGraphRunner | None,
    clock: StepClock,
) -> StepStats:
    """Bring `stats` up to date from the scheduler's parts; returns a copy of it."""
    s = stats
    s.running = len(decode.running)
    s.queued = len(prefill)
    s.pages_free = allocator.num_free
    s.pages_cached = cache.radix.total_pages if cache.radix is not None else 0
    s.pages_in_use = cache.pages_in_use()
    s.retracted = decode.num_retracted
    s.prefix_hit_tokens = prefill.hit_tokens
    s.prompt_tokens = prefill.admitted_tokens
    s.failed_steps = failed_steps
    s.decode_graph_steps = decode_graphs.replays if decode_graphs is not None else 0
    s.prompt_graph_steps = prompt_graphs.replays if prompt_graphs is not None else 0
    s.piecewise_graph_steps = piecewise_graphs.replays if piecewise_graphs is not None else 0
    s.draw_graph_steps = decode_graphs.draw_replays if decode_graphs is not None else 0
    s.step_times = clock.report()  # a copy
    return dataclasses.replace(s)
