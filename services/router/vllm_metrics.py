"""vLLM's metric names, as a view of baton's own series, so that dashboards, autoscalers
(KEDA) and the gateway inference extension built for vLLM read a baton cluster unchanged.

Nothing is measured twice: at scrape time each vLLM series is copied from the baton series
of the same meaning (the table in docs/METRICS.md), summed over the labels vLLM does not
have (`endpoint`), labelled `model_name` as vLLM's are. The router answers for the whole
cluster, as a vLLM server answers for itself: requests running and waiting are the
router's, the KV cache usage is that of the workers that decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric

# vLLM series -> the baton series it is read from (router series, by full metric name)
ALIASES: dict[str, str] = {
    "vllm:num_requests_running": "baton_router_requests_in_flight",
    "vllm:num_requests_waiting": "baton_router_requests_queued",
    "vllm:time_to_first_token_seconds": "baton_router_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "baton_router_inter_token_latency_seconds",
    # vLLM's older name for the same per-token gaps
    "vllm:time_per_output_token_seconds": "baton_router_inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "baton_router_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "baton_router_e2e_request_latency_seconds",
    "vllm:prompt_tokens": "baton_router_prompt_tokens",
    "vllm:generation_tokens": "baton_router_generation_tokens",
    "vllm:request_success": "baton_router_finished_choices",
}
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new, old name
_KV_ROLES = ("both", "decode")  # the workers whose pools hold the running requests
_DROPPED_LABELS = ("endpoint",)


@dataclass(frozen=True)
class WorkerPages:
    """One worker's KV pages, from its scrape."""

    role: str
    in_use: float
    total: float

    @classmethod
    def read(cls, role: str, values: dict[str, float]) -> WorkerPages:
        """From a worker's samples by name (its gauges of pages)."""
        in_use = values.get("baton_worker_pages_in_use", 0.0)
        free = values.get("baton_worker_pages_free", 0.0)
        cached = values.get("baton_worker_pages_cached", 0.0)
        return cls(role, in_use, in_use + free + cached)


def vllm_families(
    router: Iterable[Metric], workers: Sequence[WorkerPages], model_name: str
) -> list[Metric]:
    """The vLLM-named families read from the router's own `router` families and the
    workers' pages."""
    by_name = {family.name: family for family in router}
    out = []
    for alias, source in ALIASES.items():
        family = by_name.get(source)
        if family is not None:
            out.append(_renamed(family, alias, model_name))
    decoding = [w for w in workers if w.role in _KV_ROLES and w.total > 0]
    if decoding:
        usage = sum(w.in_use for w in decoding) / sum(w.total for w in decoding)
        for name in KV_USAGE_NAMES:
            family = Metric(
                name, "KV-cache usage of the decoding workers: 1 means 100 percent", "gauge"
            )
            family.add_sample(name, {"model_name": model_name}, usage)
            out.append(family)
    return out


def _renamed(family: Metric, alias: str, model_name: str) -> Metric:
    """`family` under vLLM's name: `_created` samples left out, the labels vLLM does not
    have summed away (a histogram's buckets sum, as its counts do)."""
    out = Metric(alias, f"{family.documentation} (vLLM's name)", family.type)
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        labels = {k: v for k, v in sample.labels.items() if k not in _DROPPED_LABELS}
        labels["model_name"] = model_name
        key = (alias + sample.name[len(family.name) :], tuple(sorted(labels.items())))
        sums[key] = sums.get(key, 0.0) + sample.value
    for (name, label_items), value in sums.items():
        out.add_sample(name, dict(label_items), value)
    return out
