"""Prometheus metrics of a worker, and its small HTTP port (/health, /metrics).

Role statistics (`StatsOut.extra`, named like `kv_bytes_sent` or `kv_state_seconds:
Transferring`) are split by unit into three families, so that no family mixes seconds,
bytes and counts in one label: `baton_worker_role_seconds`, `_bytes` and `_items` (not
`_count`, a suffix Prometheus keeps for histograms and summaries), each labelled by `name`
and `detail` (the part after ":", e.g. a state or a failure reason).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.common.engine.process import GC_PAUSE_BUCKETS
from baton.common.protocol import HostTierStats, StatsOut, TokenOut

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
                ("retracted", "requests retracted for memory (total)"),
            ]
        }
        # vLLM's names, which dashboards read: hit rate = hits / queries (in tokens)
        self.prefix_hits = Counter(
            "baton_worker_prefix_cache_hits",
            "prompt tokens found in the prefix cache",
            registry=r,
        )
        self.prefix_queries = Counter(
            "baton_worker_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self._seen_hits = 0
        self._seen_queries = 0
        self.host_tier = HostTierMetrics(r)
        self.steps = Counter("baton_worker_steps", "engine steps run", registry=r)
        self.graph_steps = Counter(
            "baton_worker_graph_steps",
            "engine steps replayed from CUDA graphs: decode (a decode batch), prompt (one "
            "prompt without a cached prefix) or piecewise (other steps with prompt rows: "
            "graphs between the layers' attentions); the rest launch kernel by kernel. draw: "
            "of the decode steps, those whose sampled rows also drew in a graph",
            ["graph"],
            registry=r,
        )
        self.mixed_steps = Counter(
            "baton_worker_mixed_steps",
            "engine steps that computed prompt tokens beside running requests' decode rows "
            "(--enable-mixed-chunk; a decode worker computing a prompt itself)",
            registry=r,
        )
        self.stalled_steps = Counter(
            "baton_worker_stalled_steps",
            "engine steps of 0.5 s or more and 4x what the worker's own step-time fit "
            "predicted: a kernel compiled for a new shape or a host pause, not load (each "
            "logged, rate-limited); every running stream waited through it",
            registry=r,
        )
        self._seen_steps = dict.fromkeys(
            ("all", "decode", "prompt", "piecewise", "draw", "mixed", "stalled"), 0
        )
        self.gc_pauses = Histogram(
            "baton_worker_gc_pause_seconds",
            "the scheduler process's garbage collections, by generation: each stops the step "
            "loop, and every running stream with it",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS,
            registry=r,
        )
        self.role_stats = {
            unit: Gauge(
                f"baton_worker_role_{unit}",
                f"role statistics in {unit} (queues, KV transfer, room failures)",
                ["name", "detail"],
                registry=r,
            )
            for unit in ("seconds", "bytes", "items")
        }
        self.dropped_messages = Counter(
            "baton_worker_dropped_messages",
            "malformed messages from the scheduler process, dropped",
            registry=r,
        )
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
        # The scheduler reports running totals; counters take the growth since last time.
        self.prefix_hits.inc(max(s.prefix_hit_tokens - self._seen_hits, 0))
        self.prefix_queries.inc(max(s.prompt_tokens - self._seen_queries, 0))
        self._seen_hits, self._seen_queries = s.prefix_hit_tokens, s.prompt_tokens
        totals = {
            "all": s.steps,
            "decode": s.decode_graph_steps,
            "prompt": s.prompt_graph_steps,
            "piecewise": s.piecewise_graph_steps,
            "draw": s.draw_graph_steps,
            "mixed": s.mixed_steps,
            "stalled": s.stalled_steps,
        }
        plain = {"all": self.steps, "mixed": self.mixed_steps, "stalled": self.stalled_steps}
        for kind, total in totals.items():
            grown = max(total - self._seen_steps[kind], 0)
            counter = plain.get(kind) or self.graph_steps.labels(graph=kind)
            counter.inc(grown)
            self._seen_steps[kind] = total
        if s.host_tier is not None:
            self.host_tier.observe(s.host_tier)
        for generation, seconds in s.gc_pauses:
            self.gc_pauses.labels(generation=str(generation)).observe(seconds)
        for key, value in s.extra.items():
            name, _, detail = key.partition(":")
            unit = (
                "seconds" if name.endswith("seconds") else "bytes" if "bytes" in name else "items"
            )
            self.role_stats[unit].labels(name=name, detail=detail).set(value)

    def observe_finish(self, out: TokenOut, seconds: float) -> None:
        self.requests.labels(finish_reason=out.finish_reason or "none").inc()
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(out.completion_tokens)
        self.e2e.observe(seconds)
        for stage, value in out.timings.items():
            self.stage.labels(stage=stage).observe(value)


class HostTierMetrics:
    """The prefix cache's host-memory tier (`--host-kv-tokens`); absent values stay 0."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.hits = Counter(
            "baton_worker_host_kv_hit_tokens",
            "prompt tokens whose KV was loaded back from the host-memory tier",
            registry=r,
        )
        self.moved = Counter(
            "baton_worker_host_kv_moved_bytes",
            "KV bytes copied between the device pool and the host tier",
            ["direction"],
            registry=r,
        )
        self.stall = Counter(
            "baton_worker_host_kv_load_stall_seconds",
            "time steps waited for their copies to and from the host tier before the forward",
            registry=r,
        )
        self.dropped = Counter(
            "baton_worker_host_kv_dropped_pages",
            "host-tier pages dropped, least recently used, to make room",
            registry=r,
        )
        self.pages_used = Gauge(
            "baton_worker_host_kv_pages_used", "host-tier pages holding KV", registry=r
        )
        self.pages_total = Gauge(
            "baton_worker_host_kv_pages_capacity", "host-tier pages in all", registry=r
        )
        for direction in ("to_host", "to_device"):
            self.moved.labels(direction=direction)
        self._seen = HostTierStats(0, 0, 0, 0.0, 0, 0, 0)

    def observe(self, s: HostTierStats) -> None:
        # The scheduler reports running totals; counters take the growth since last time.
        seen = self._seen
        self.hits.inc(max(s.hit_tokens - seen.hit_tokens, 0))
        self.moved.labels(direction="to_host").inc(max(s.bytes_to_host - seen.bytes_to_host, 0))
        self.moved.labels(direction="to_device").inc(
            max(s.bytes_to_device - seen.bytes_to_device, 0)
        )
        self.stall.inc(max(s.load_stall_seconds - seen.load_stall_seconds, 0.0))
        self.dropped.inc(max(s.dropped_pages - seen.dropped_pages, 0))
        self.pages_used.set(s.pages_used)
        self.pages_total.set(s.pages_total)
        self._seen = s
