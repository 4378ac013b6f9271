"""The router's Prometheus metrics, in a registry of its own (one per app, so that several
routers in one test process do not collide), and the cluster's metrics in one scrape.

Every request metric carries `model_name` (the served name), as vLLM's do. `render`
appends the workers' own metrics, fetched from their HTTP ports at scrape time and
labelled with `worker_id` and `role`, so that one scrape sees the whole cluster (a
worker that does not answer in time is left out of that scrape and counted in
`baton_router_federation_errors_total`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from baton.services.router.admission import Admission
from baton.services.router.metric_collectors import (
    ROUTER_GC_PAUSES,
    Families,
    KVIndexCollector,
    PlacementInputs,
    WorkerCollector,
    WorkerInputs,
)
from baton.services.router.migration import KINDS as MIGRATION_KINDS
from baton.services.router.migration import REASONS as MIGRATION_REASONS
from baton.services.router.placement import KINDS as PLACEMENT_KINDS
from baton.services.router.vllm_metrics import WorkerPages, vllm_families

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 2.0

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0
)  # fmt: skip
_KV_LAG_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0
)  # fmt: skip


class RouterMetrics:
    def __init__(
        self,
        workers_by_role: Callable[[], dict[str, int]],
        model_name: str,
        registry_connected: Callable[[], bool | None] = lambda: None,
        vllm_names: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.requests = Counter(
            "baton_router_requests",
            "HTTP requests answered, by endpoint and status code",
            ["model_name", "endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = self._histogram(
            "baton_router_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
        )
        self.e2e = self._histogram(
            "baton_router_e2e_request_latency_seconds",
            "Seconds from a generation request's arrival to its last byte",
        )
        self.tpot = self._histogram(
            "baton_router_time_per_output_token_seconds",
            "Per request: seconds from its first to its last token, per token after the first",
            _TOKEN_BUCKETS,
        )
        self.itl = self._histogram(
            "baton_router_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a generation (a chunk of k tokens after "
            "a gap g counts k gaps of g/k)",
            _TOKEN_BUCKETS,
        )
        self.placements = Counter(
            "baton_router_placements",
            "Attempts placed on a prefill/decode pair, by kind: 'local' (D computes the "
            "prompt), 'disagg-delta' (P computes it, only pages D lacks travel), "
            "'disagg-full' (every page travels)",
            ["kind"],
            registry=self.registry,
        )
        self.placement_prefill_tokens = Counter(
            "baton_router_placement_prefill_tokens",
            "Prompt tokens computed (not found in a cache) by the worker each attempt was "
            "placed on, by placement kind: P for 'disagg-*', D for 'local'",
            ["kind"],
            registry=self.registry,
        )
        self.handed_back = Counter(
            "baton_router_local_handed_back",
            "Prompts placed 'local' that their decode worker handed back unstarted (its "
            "running requests had no TPOT slack for them within the share of the TTFT SLO "
            "they were given), then placed again, never local on that worker",
            registry=self.registry,
        )
        self.reruns = Counter(
            "baton_router_reruns",
            "Generations run again on other workers after a worker failed: 'retry' before "
            "any output, 'migration' after (the stream continues where it stood)",
            ["kind"],
            registry=self.registry,
        )
        self.worker_suspensions = Counter(
            "baton_router_worker_suspensions",
            "Workers taken out of routing because their address refused a connection "
            "(router/workers.py: until they register again)",
            registry=self.registry,
        )
        self.worker_lapses = Counter(
            "baton_router_worker_lapses",
            "Workers the registry dropped while requests ran on them, by how it ended: "
            "returned (registered again, nothing moved), not_answering (their requests "
            "moved on) or idle (nothing ran on them any more)",
            ["outcome"],
            registry=self.registry,
        )
        self.waits_for_worker = Counter(
            "baton_router_waits_for_worker",
            "Generations that found no worker while a suspended one might return, by "
            "outcome: 'served' (one joined in time) or 'gave_up'",
            ["outcome"],
            registry=self.registry,
        )
        for kind in ("retry", "migration"):  # exported at 0 from the start, so that a
            self.reruns.labels(kind)  # dashboard's rate shows 0, not "no data"
        for outcome in ("served", "gave_up"):  # (the same)
            self.waits_for_worker.labels(outcome)
        for kind in PLACEMENT_KINDS:  # (the same)
            self.placements.labels(kind)
            self.placement_prefill_tokens.labels(kind)
        self.in_flight = Gauge(
            "baton_router_requests_in_flight",
            "Generation requests being served",
            ["model_name"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "baton_router_prompt_tokens",
            "Prompt tokens of the generation requests served (each prompt once, whatever n)",
            ["model_name"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "baton_router_generation_tokens",
            "Tokens generated for clients",
            ["model_name"],
            registry=self.registry,
        )
        self.finished_choices = Counter(
            "baton_router_finished_choices",
            "Choices (a generation each) that finished, by why: stop, length, ...",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.role_changes = Counter(
            "baton_router_role_changes",
            "Worker role changes asked of the router (POST /admin/workers/{id}/role), by the "
            "role changed to and outcome: 'done', 'refused' (the worker serves on in its "
            "old role) or 'unconfirmed' (it changed, but its registration did not reach the "
            "router in time)",
            ["role", "outcome"],
            registry=self.registry,
        )
        self.role_change_seconds = Histogram(
            "baton_router_role_change_seconds",
            "Seconds a done role change took, from the request to the worker serving in its "
            "new role (its requests drained or moved, its scheduler switched, re-registered)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        for role in ("prefill", "decode", "both"):  # (exported at 0 from the start)
            for outcome in ("done", "refused", "unconfirmed"):
                self.role_changes.labels(role, outcome)
        self._migration_metrics()
        self.federation_errors = Counter(
            "baton_router_federation_errors",
            "Worker metric scrapes that failed or timed out",
            registry=self.registry,
        )
        self.registry.register(WorkerCollector(workers_by_role, registry_connected))
        self.registry.register(ROUTER_GC_PAUSES)
        self._kv_event_metrics()

    def _migration_metrics(self) -> None:
        """Generations moved between workers while they run (`migration.py`)."""
        self.migrations = Counter(
            "baton_router_migrations",
            "Generations that continued on another worker after output, by kind ('live': "
            "their KV copied, 'recompute': the new worker computed prompt and output so far) "
            "and reason ('admin': POST /admin/migrate, 'role_change', 'worker_failed')",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.migration_bytes = Counter(
            "baton_router_migration_bytes",
            "KV bytes live migrations copied from one worker to another",
            registry=self.registry,
        )
        self.migration_pages = Counter(
            "baton_router_migration_pages",
            "Pages of the contexts live migrations moved, by phase: 'precopy' (copied to the "
            "target's prefix cache while the source decoded on), 'cutover' (the rest, at "
            "the hand-off, pages the target held in its own cache included)",
            ["phase"],
            registry=self.registry,
        )
        self.migration_recomputed_tokens = Counter(
            "baton_router_migration_recomputed_tokens",
            "Tokens (prompt and output so far) computed again by the new worker of a "
            "planned recompute migration",
            registry=self.registry,
        )
        self.migration_stall = Histogram(
            "baton_router_migration_stall_seconds",
            "Per migrated generation, once it ends: the longest gap between two consecutive "
            "outputs passed on, from the last output before its first migration to its end: "
            "the cutover and every later gap on the new worker (an output holds up to the "
            "worker's --stream-interval tokens)",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.migration_cutover = Histogram(
            "baton_router_migration_cutover_seconds",
            "Per migration after output: the gap from the last output the old worker passed "
            "on to the first the new worker passed on (the hand-off alone)",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        for phase in ("precopy", "cutover"):  # (exported at 0 from the start)
            self.migration_pages.labels(phase)
        for kind in MIGRATION_KINDS:  # (the same)
            for reason in MIGRATION_REASONS:
                self.migrations.labels(kind, reason)

    def moved(
        self, kind: str, reason: str, tokens: int, token_bytes: float, page_size: int, warmed: int
    ) -> None:
        """A migration of a context of `tokens`: a live one's bytes and pages by phase
        (`warmed` pages pre-copied), a recompute's tokens computed again."""
        self.migrations.labels(kind, reason).inc()
        if kind == "live":
            self.migration_bytes.inc(tokens * token_bytes)
            pages = -(-tokens // page_size)
            self.migration_pages.labels("precopy").inc(warmed)
            self.migration_pages.labels("cutover").inc(max(0, pages - warmed))
        else:
            self.migration_recomputed_tokens.inc(tokens)

    def _kv_event_metrics(self) -> None:
        """The exact prefix index's (`kv_index.py`): how far behind the workers' caches it
        is, and how well it predicts the cache hits workers then find."""
        self.kv_event_lag = Histogram(
            "baton_router_kv_event_lag_seconds",
            "Seconds from a KV event batch's creation on its worker to its application here",
            buckets=_KV_LAG_BUCKETS,
            registry=self.registry,
        )
        self.kv_events_applied = Counter(
            "baton_router_kv_events_applied",
            "Page events (a chain stored, pages removed) applied to the exact prefix index",
            registry=self.registry,
        )
        self.kv_resyncs = Counter(
            "baton_router_kv_resyncs",
            "Times the exact index lost sync with a worker and asked for a snapshot, by why: "
            "gap, inconsistent, incarnation, overflow",
            ["reason"],
            registry=self.registry,
        )
        self.kv_hit_tokens_predicted = Counter(
            "baton_router_kv_hit_tokens_predicted",
            "Prompt tokens routing expected the chosen worker to find cached, for workers whose "
            "KV events are followed",
            ["role"],
            registry=self.registry,
        )
        self.kv_hit_tokens_found = Counter(
            "baton_router_kv_hit_tokens_found",
            "Prompt tokens those workers reported found cached (cached_tokens of their "
            "finished responses)",
            ["role"],
            registry=self.registry,
        )

    def watch_kv_index(
        self,
        pages_by_worker: Callable[[], dict[str, int]],
        host_pages_by_worker: Callable[[], dict[str, int]],
    ) -> None:
        """Export the exact index's pages per worker, all and on the host tier, read at
        scrape time."""
        self.registry.register(KVIndexCollector(pages_by_worker, host_pages_by_worker))

    def watch_placement(
        self, read: Callable[[], tuple[dict[str, WorkerInputs], float | None]]
    ) -> None:
        """Export what the cost placement reads of each worker, read at scrape time."""
        self.registry.register(PlacementInputs(read))

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(
            name, doc, ["model_name", "endpoint"], buckets=buckets, registry=self.registry
        )

    def watch_admission(self, admission: Admission) -> None:
        """Export the admission line's state, read at scrape time."""
        Gauge(
            "baton_router_requests_queued",
            "Generation requests waiting for a slot",
            registry=self.registry,
        ).set_function(lambda: admission.queued)
        Gauge(
            "baton_router_concurrency_limit",
            "Generation requests the router runs at once (fixed, or from worker capacity)",
            registry=self.registry,
        ).set_function(lambda: admission.limit())

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_cluster(self, workers: Sequence[tuple[str, str, str]]) -> bytes:
        """The router's metrics and then every worker's: (worker_id, role, http address)."""
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
            texts = await asyncio.gather(*(_scrape(client, w[2]) for w in workers))
        families: dict[str, Metric] = {}
        pages: list[WorkerPages] = []
        for (worker_id, role, address), text in zip(workers, texts, strict=True):
            if text is None:
                self.federation_errors.inc()
                log.debug("no metrics from worker %s at %s", worker_id, address)
                continue
            extra = {"worker_id": worker_id, "role": role, "model_name": self.model_name}
            values = {}
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, **extra}, sample.value)
                    values[sample.name] = sample.value
            pages.append(WorkerPages.read(role, values))
        vllm = (
            vllm_families(self.registry.collect(), pages, self.model_name)
            if self.vllm_names
            else []
        )
        federated = CollectorRegistry()
        federated.register(Families(list(families.values()) + vllm))
        return self.render() + generate_latest(federated)


async def _scrape(client: httpx.AsyncClient, address: str) -> str | None:
    if not address:
        return None
    try:
        response = await client.get(f"http://{address}/metrics")
        response.raise_for_status()
        return response.text
    except httpx.HTTPError:
        return None
