"""The router's /metrics times its process's garbage collections (each stops every stream it
relays), counted as they happen, whether or not anyone scrapes."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from baton.services.router.metric_collectors import GcPauseCollector


def test_collections_show_by_generation_once_each() -> None:
    pauses = GcPauseCollector()
    registry = CollectorRegistry()
    registry.register(pauses)
    assert (
        'baton_router_gc_pause_seconds_count{generation="2"} 0.0'
        in generate_latest(registry).decode()
    )
    pauses.start()
    try:
        gc.collect()
        gc.collect()
    finally:
        pauses.stop()
    for _ in range(2):  # a second scrape counts the same two
        text = generate_latest(registry).decode()
        assert 'baton_router_gc_pause_seconds_count{generation="2"} 2.0' in text
        assert 'baton_router_gc_pause_seconds_bucket{generation="2",le="+Inf"} 2.0' in text
    gc.collect()  # no longer counted
    assert (
        'baton_router_gc_pause_seconds_count{generation="2"} 2.0'
        in generate_latest(registry).decode()
    )
