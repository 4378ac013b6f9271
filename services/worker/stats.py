"""What a worker's scheduler process reports to its frontend (`StatsOut`): the
scheduler's counts and totals, its role's, its host tier's and its garbage collections."""

from __future__ import annotations

from baton.common.engine.scheduler import Scheduler
from baton.common.protocol import HostTierStats, StatsOut


def stats_message(
    scheduler: Scheduler, extra: dict[str, float], gc_pauses: list[tuple[int, float]] | None = None
) -> StatsOut:
    """What the scheduler process reports to its frontend every `STATS_INTERVAL`: its
    counts and totals, the role's `extra`, and the garbage collections since the last."""
    s = scheduler.step_stats()
    total = scheduler.cfg.num_pages
    return StatsOut(
        running=s.running,
        queued=s.queued + int(extra.get("queued_disagg", 0)),
        pages_free=s.pages_free,
        pages_cached=s.pages_cached,
        pages_in_use=s.pages_in_use,
        prefix_hit_tokens=s.prefix_hit_tokens,
        prompt_tokens=s.prompt_tokens,
        token_usage=s.pages_in_use / total if total else 0.0,
        retracted=s.retracted,
        steps=s.steps,
        decode_graph_steps=s.decode_graph_steps,
        prompt_graph_steps=s.prompt_graph_steps,
        piecewise_graph_steps=s.piecewise_graph_steps,
        draw_graph_steps=s.draw_graph_steps,
        mixed_steps=s.mixed_steps,
        stalled_steps=s.stalled_steps,
        step_times=s.step_times,
        kv_bytes_sent=extra.get("kv_bytes_sent", 0.0),
        kv_send_seconds=extra.get("kv_send_seconds", 0.0),
        prefix_cache=scheduler.cache.radix is not None,
        extra=extra,
        host_tier=host_tier_stats(scheduler),
        gc_pauses=gc_pauses or [],
    )


def host_tier_stats(scheduler: Scheduler) -> HostTierStats | None:
    radix = scheduler.cache.radix
    if radix is None or radix.tier is None:
        return None
    tier, c = radix.tier, radix.tier.counters
    return HostTierStats(
        hit_tokens=c.hit_tokens,
        bytes_to_host=c.bytes_to_host,
        bytes_to_device=c.bytes_to_device,
        load_stall_seconds=c.load_stall_seconds,
        dropped_pages=c.dropped_pages,
        pages_used=tier.pages_used,
        pages_total=tier.num_pages,
    )
