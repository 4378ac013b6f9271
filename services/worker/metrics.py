"""Prometheus metrics of a worker, and its small HTTP port (/health, /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.common.protocol import StatsOut, TokenOut

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_running = Gauge("baton_worker_streams", "open Generate streams", registry=r)
        self.requests = Counter(
            "baton_worker_requests", "finished requests", ["finish_reason"], registry=r
        )
        self.aborts = Counter(
            "baton_worker_aborted_streams", "streams closed before the request finished", registry=r
        )
        self.prompt_tokens = Counter("baton_worker_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "baton_worker_generation_tokens", "generated tokens", registry=r
        )
        self.e2e = Histogram(
            "baton_worker_request_seconds",
            "request time in this worker",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "baton_worker_stage_seconds",
            "time per request stage",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gauges = {
            name: Gauge(f"baton_worker_{name}", help_text, registry=r)
            for name, help_text in [
                ("running", "requests in the running batch"),
                ("queued", "requests waiting (all queues)"),
                ("pages_free", "free KV pages"),
                ("pages_cached", "KV pages held by the prefix cache"),
                ("pages_in_use", "KV pages held by requests"),
                ("token_usage", "fraction of KV pages in use"),
                ("prefix_hit_tokens", "prompt tokens served from the prefix cache (total)"),
                ("retracted", "requests retracted for memory (total)"),
            ]
        }
        self.extra = Gauge("baton_worker_role_stat", "role-specific counters", ["name"], registry=r)
        self.info = Gauge("baton_worker_info", "worker identity", ["role"], registry=r)
        self.registry_registered = Gauge(
            "baton_worker_registry_registered",
            "1 while registered and the registry answers renewals; 0 while it is unreachable "
            "(the worker keeps serving and retrying) or refuses the worker",
            registry=r,
        )
        self.info.labels(role=role).set(1)

    def observe_stats(self, s: StatsOut) -> None:
        for name, gauge in self.gauges.items():
            gauge.set(float(getattr(s, name)))
        for name, value in s.extra.items():
            self.extra.labels(name=name).set(value)

    def observe_finish(self, out: TokenOut, seconds: float) -> None:
        self.requests.labels(finish_reason=out.finish_reason or "none").inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.e2e.observe(seconds)
        for stage, value in out.timings.items():
            self.stage.labels(stage=stage).observe(value)
