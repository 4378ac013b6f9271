"""A worker's Prometheus counters follow the scheduler's running totals."""

from __future__ import annotations

import gc
import subprocess
import sys

from prometheus_client import generate_latest

from baton.common.engine.process import GcPauses
from baton.common.protocol import StatsOut
from baton.services.worker.metrics import WorkerMetrics

_IDLE = {
    "running": 0,
    "queued": 0,
    "pages_free": 8,
    "pages_cached": 0,
    "pages_in_use": 0,
    "prefix_hit_tokens": 0,
    "prompt_tokens": 0,
    "token_usage": 0.0,
    "retracted": 0,
}


def test_steps_and_graph_replays_count_what_the_scheduler_reported() -> None:
    metrics = WorkerMetrics("prefill")
    metrics.observe_stats(StatsOut(**_IDLE, steps=10, decode_graph_steps=6, prompt_graph_steps=3))
    metrics.observe_stats(
        StatsOut(**_IDLE, steps=15, decode_graph_steps=8, prompt_graph_steps=5, draw_graph_steps=2)
    )
    metrics.observe_stats(
        StatsOut(
            **_IDLE,
            steps=15,
            decode_graph_steps=8,
            prompt_graph_steps=5,
            draw_graph_steps=2,
            mixed_steps=4,
            stalled_steps=1,
        )
    )
    text = generate_latest(metrics.registry).decode()
    assert "baton_worker_steps_total 15.0" in text
    assert 'baton_worker_graph_steps_total{graph="decode"} 8.0' in text
    assert 'baton_worker_graph_steps_total{graph="prompt"} 5.0' in text
    assert 'baton_worker_graph_steps_total{graph="draw"} 2.0' in text
    assert "baton_worker_mixed_steps_total 4.0" in text
    assert "baton_worker_stalled_steps_total 1.0" in text


def test_garbage_collections_are_recorded_reported_and_counted_once() -> None:
    """A full collection stops every stream of a worker: the scheduler process records
    each collection, hands them over once with its stats, and /metrics counts them by
    generation."""
    pauses = GcPauses().start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.stop()
    taken = pauses.take()
    assert [g for g, _ in taken][-2:] == [2, 0] and all(s >= 0 for _, s in taken)
    assert pauses.take() == []  # handed over once
    gc.collect()
    assert pauses.take() == []  # stopped: no longer recorded
    metrics = WorkerMetrics("decode")
    metrics.observe_stats(StatsOut(**_IDLE, steps=1, gc_pauses=[(2, 0.12), (0, 0.0004)]))
    metrics.observe_stats(StatsOut(**_IDLE, steps=2, gc_pauses=[(2, 0.03)]))
    text = generate_latest(metrics.registry).decode()
    assert 'baton_worker_gc_pause_seconds_count{generation="2"} 2.0' in text
    assert 'baton_worker_gc_pause_seconds_bucket{generation="2",le="0.05"} 1.0' in text
    assert 'baton_worker_gc_pause_seconds_count{generation="0"} 1.0' in text


_CHURN = """
import sys
from baton.common.engine.process import GcPauses, freeze_heap
if sys.argv[1] == "freeze":
    freeze_heap()
keep = []
with GcPauses() as pauses:
    for i in range(600_000):  # requests' state coming and going: lists that live a while
        keep.append([i])
        if len(keep) > 50_000:
            keep = keep[25_000:]
print(sum(1 for generation, _ in pauses.pauses if generation == 2))
"""


def test_a_serving_process_runs_full_collections_rarely() -> None:
    """A full collection walks every running request's token lists while every stream
    waits: after `freeze_heap` (a worker's scheduler process, once up) the same churn of
    long-lived objects runs at most a tenth as many (subprocesses: the test process's
    collector is left as it is)."""

    def full_collections(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    default = full_collections("default")
    assert default >= 5
    assert full_collections("freeze") <= default // 10
