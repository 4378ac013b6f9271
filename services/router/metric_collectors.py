"""Collectors read at scrape time: the router's workers by role, its exact KV index's pages,
its process's garbage collections, and a fixed list of families (a federated scrape's)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.common.engine.process import GcPauses

# The router process's collections, recorded from when `baton router` starts serving (its
# main); in a process that never starts it (tests) the metric stays empty.
ROUTER_GC_PAUSES = GcPauses()


class Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class WorkerCollector(Collector):
    """Workers known by role, and whether the registry is reachable, read at scrape time."""

    def __init__(
        self,
        workers_by_role: Callable[[], dict[str, int]],
        registry_connected: Callable[[], bool | None],
    ) -> None:
        self._workers_by_role = workers_by_role
        self._registry_connected = registry_connected

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "baton_router_workers", "Workers known to the router, by role", labels=["role"]
        )
        for role, count in sorted(self._workers_by_role().items()):
            family.add_metric([role], count)
        families = [family]
        connected = self._registry_connected()
        if connected is not None:
            families.append(
                GaugeMetricFamily(
                    "baton_router_registry_connected",
                    "1 while the membership watch is live; 0 while the registry is "
                    "unreachable and the last known workers keep serving",
                    value=float(connected),
                )
            )
        return families


class KVIndexCollector(Collector):
    """Pages the exact prefix index holds per worker, read at scrape time."""

    def __init__(
        self,
        pages_by_worker: Callable[[], dict[str, int]],
        host_pages_by_worker: Callable[[], dict[str, int]],
    ) -> None:
        self._pages_by_worker = pages_by_worker
        self._host_pages_by_worker = host_pages_by_worker

    def collect(self) -> list[GaugeMetricFamily]:
        families = []
        for name, help_text, read in (
            (
                "baton_router_kv_index_pages",
                "Pages of each worker's prefix cache in the router's exact index",
                self._pages_by_worker,
            ),
            (
                "baton_router_kv_index_host_pages",
                "Of those pages, the ones on the worker's host-memory tier",
                self._host_pages_by_worker,
            ),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["worker_id"])
            for worker_id, pages in sorted(read().items()):
                family.add_metric([worker_id], pages)
            families.append(family)
        return families


class GcPauseCollector(Collector):
    """The collections `pauses` recorded, as a histogram by generation: each one stops the
    event loop, and every stream the router relays with it. Drained at scrape time (a
    collector callback may not take the histogram's lock: it runs inside the collection)."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses
        self._histogram = Histogram(
            "baton_router_gc_pause_seconds",
            "the router process's garbage collections, by generation: each stops every "
            "stream the router relays",
            ["generation"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=None,
        )

    def collect(self) -> list[Metric]:
        for generation, seconds in self._pauses.take():
            self._histogram.labels(generation=str(generation)).observe(seconds)
        return list(self._histogram.collect())
