"""The router's Prometheus metrics, in a registry of its own (one per app, so that several
routers in one test process do not collide)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0
)  # fmt: skip


class RouterMetrics:
    def __init__(
        self,
        workers_by_role: Callable[[], dict[str, int]],
        registry_connected: Callable[[], bool | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "baton_router_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "baton_router_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "baton_router_e2e_request_latency_seconds",
            "Seconds from a generation request's arrival to its last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "baton_router_requests_in_flight",
            "Generation requests being served",
            registry=self.registry,
        )
        self.registry.register(_WorkerCollector(workers_by_role, registry_connected))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
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
