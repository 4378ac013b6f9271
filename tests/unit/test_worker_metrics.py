"""A worker's Prometheus counters follow the scheduler's running totals."""

from __future__ import annotations

from prometheus_client import generate_latest

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
        StatsOut(**_IDLE, steps=15, decode_graph_steps=8, prompt_graph_steps=5, draw_graph_steps=2)
    )
    text = generate_latest(metrics.registry).decode()
    assert "baton_worker_steps_total 15.0" in text
    assert 'baton_worker_graph_steps_total{graph="decode"} 8.0' in text
    assert 'baton_worker_graph_steps_total{graph="prompt"} 5.0' in text
    assert 'baton_worker_graph_steps_total{graph="draw"} 2.0' in text
