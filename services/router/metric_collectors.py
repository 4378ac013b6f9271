"""Collectors read at scrape time: the router's workers by role, its exact KV index's pages,
what the cost placement reads of each worker, its process's garbage collections, and a
fixed list of families (a federated scrape's)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.common.engine.process import GC_PAUSE_BUCKETS, GcPauses
from baton.common.step_times import Line


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
    """The process's garbage collections, as a histogram by generation: each one stops the
    event loop, and every stream the router relays with it. Counted as they happen, in
    plain counters (a `gc` callback runs inside the collection and may take no lock), from
    `start()` on; read at scrape time. Bounded whether or not anyone scrapes."""

    def __init__(self) -> None:
        # per generation: how many fell in each bucket (the last: above every bound)
        self._counts = [[0] * (len(GC_PAUSE_BUCKETS) + 1) for _ in range(3)]
        self._sums = [0.0] * 3
        self._pauses = GcPauses(on_pause=self._count)

    def start(self) -> None:
        self._pauses.start()

    def stop(self) -> None:
        self._pauses.stop()

    def _count(self, generation: int, seconds: float) -> None:
        self._counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
        self._sums[generation] += seconds

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(
            "baton_router_gc_pause_seconds",
            "the router process's garbage collections, by generation: each stops every "
            "stream the router relays",
            labels=["generation"],
        )
        for generation, counts in enumerate(self._counts):
            cumulative = list(itertools.accumulate(counts))
            buckets = [(str(b), c) for b, c in zip(GC_PAUSE_BUCKETS, cumulative, strict=False)]
            family.add_metric(
                [str(generation)],
                [*buckets, ("+Inf", cumulative[-1])],
                sum_value=self._sums[generation],
            )
        return [family]


# The router process's collections, counted from when `baton router` starts serving (its
# main); in a process that never starts it (tests) the counts stay at zero.
ROUTER_GC_PAUSES = GcPauseCollector()


@dataclass(frozen=True)
class WorkerInputs:
    """One worker as the cost placement reads it (`PlacementInputs`)."""

    prefill: Line | None  # None: not fitted yet
    decode: Line | None
    decode_step: float | None  # its latest mean decode step; None: none measured
    owed: int  # local prompts' tokens placed on it, first token not yet back


class PlacementInputs(Collector):
    """What the cost placement reads of each worker (`placer.Placer.inputs`): its fitted
    step lines, its latest decode step, the local prompt tokens it owes, and the measured
    KV transfer rate; read at scrape time, so that a run shows why it placed as it did."""

    def __init__(self, read: Callable[[], tuple[dict[str, WorkerInputs], float | None]]) -> None:
        self._read = read

    def collect(self) -> list[GaugeMetricFamily]:
        workers, rate = self._read()
        lines = GaugeMetricFamily(
            "baton_router_step_line_seconds",
            "Each worker's step line as the router predicts by it (prompt steps: the "
            "worker's own fit where it reports one, else the router's fit of its reports): "
            "seconds = intercept + slope x size (prompt tokens, or decode rows) + attention "
            "x (query, key) pairs",
            labels=["worker_id", "kind", "term"],
        )
        step = GaugeMetricFamily(
            "baton_router_decode_step_now_seconds",
            "Each worker's mean decode step over its latest report interval",
            labels=["worker_id"],
        )
        owed = GaugeMetricFamily(
            "baton_router_prompt_tokens_owed",
            "Prompt tokens of requests whose prompt each worker computes (a prefill worker's, "
            "a decode worker's placed local) and whose first token is not back yet",
            labels=["worker_id"],
        )
        for worker_id, inputs in sorted(workers.items()):
            for kind, line in (("prefill", inputs.prefill), ("decode", inputs.decode)):
                if line is not None:
                    for term in ("intercept", "slope", "attention"):
                        lines.add_metric([worker_id, kind, term], getattr(line, term))
            if inputs.decode_step is not None:
                step.add_metric([worker_id], inputs.decode_step)
            owed.add_metric([worker_id], inputs.owed)
        families = [lines, step, owed]
        if rate is not None:
            families.append(
                GaugeMetricFamily(
                    "baton_router_kv_transfer_bytes_per_second",
                    "KV bytes prefill workers sent per second of their transfer threads' "
                    "sending, as the cost placement uses it (the last ~10 s weigh most)",
                    value=rate,
                )
            )
        return families
