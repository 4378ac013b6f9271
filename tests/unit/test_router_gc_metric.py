"""The router's /metrics times its process's garbage collections (each stops every stream it
relays), counted once each."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from baton.common.engine.process import GcPauses
from baton.services.router.metric_collectors import GcPauseCollector


def test_collections_show_by_generation_once_each() -> None:
    pauses = GcPauses()
    registry = CollectorRegistry()
    registry.register(GcPauseCollector(pauses))
    assert "baton_router_gc_pause_seconds_count" not in generate_latest(registry).decode()
    pauses.start()
    try:
        gc.collect()
        gc.collect()
    finally:
        pauses.stop()
    text = generate_latest(registry).decode()
    assert 'baton_router_gc_pause_seconds_count{generation="2"} 2.0' in text
    # drained into the histogram: a second scrape counts the same two
    text = generate_latest(registry).decode()
    assert 'baton_router_gc_pause_seconds_count{generation="2"} 2.0' in text
