"""Settings of one `baton bench serve` run, resolved once from flags or built in Python.

`BenchConfig` is the whole contract between the command line, the sweep and the
benchmark core: the sweep makes one per (cluster, rate) with `dataclasses.replace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from baton.benchmarks.flags import (
    ENDPOINT_PATHS,
    PERCENTILE_METRICS,
    SLO_METRICS,
    Limits,
    Listed,
    endpoint_name,
    metric_names,
    percentiles,
    slo_flag,
)
from baton.benchmarks.phases import Phase, Phases, phases_flag
from baton.common.options import Option, option

DATASETS = ("random", "shared-prefix", "jsonl", "trace", "mooncake")
# Datasets whose requests arrive at recorded times, not at --request-rate.
TRACE_DATASETS = ("trace", "mooncake")
# Used when neither --num-requests nor --duration bounds the run.
DEFAULT_NUM_REQUESTS = 100


class BenchConfigError(ValueError):
    """A setting, or a combination of settings, that cannot describe a run."""


@dataclass(frozen=True)
class BenchConfig:
    """Every field with an `option` is a flag of `bench serve` (and of `pd-sweep`, less
    those a sweep sets per point: `sweep_config.SWEPT`)."""

    base_url: str = option("http://127.0.0.1:8000", "server to load")
    endpoint: str = option(
        "completions",
        "API to call: completions or chat (or its path, as vLLM's flag: /v1/completions, "
        "/v1/chat/completions)",
        choices=tuple(sorted(ENDPOINT_PATHS)),
        parse=endpoint_name,
    )
    model: str | None = option(None, "model name (default: first of /v1/models)")
    api_key: str | None = option(None, "sent as a Bearer token")
    tokenizer: str | None = option(
        None,
        "model folder whose tokenizer counts prompt lengths (default: --model when it is "
        "a folder, else the folder the server names as the model's root in /v1/models)",
    )
    trust_remote_code: bool = option(
        False, "let the tokenizer's folder run its own code (transformers' flag)"
    )

    # When requests are sent.
    request_rate: float = option(
        math.inf, "requests per second; inf sends all at once", group="when requests are sent"
    )
    burstiness: float = option(
        1.0,
        "gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier",
        group="when requests are sent",
    )
    max_concurrency: int | None = option(
        None,
        "cap on requests in flight (the clock starts when a slot frees)",
        group="when requests are sent",
    )
    num_requests: int | None = option(
        None,
        "measured requests (default 100 unless --duration is given); --num-prompts is the same",
        group="when requests are sent",
    )  # warmup comes on top
    duration_s: float | None = option(
        None,
        "seconds during which requests are sent",
        flag="--duration",
        group="when requests are sent",
    )
    warmup: int = option(
        0,
        "extra requests sent first and left out of the statistics",
        group="when requests are sent",
    )
    seed: int = option(0, "seed of the arrivals and the prompts", group="when requests are sent")

    # What is sent.
    dataset: str = option("random", "what is sent", choices=DATASETS, group="what is sent")
    dataset_path: str | None = option(None, "jsonl / trace / mooncake file", group="what is sent")
    input_len: int = option(
        256, "prompt tokens (shared-prefix: tokens after the shared prefix)", group="what is sent"
    )
    output_len: int = option(64, "max_tokens of synthetic requests", group="what is sent")
    range_ratio: float = option(
        0.0, "lengths drawn uniformly from len*[1-r, 1+r]", group="what is sent"
    )
    num_groups: int = option(
        8, "shared-prefix: number of distinct shared system prompts", group="what is sent"
    )
    prefix_len: int = option(
        512, "shared-prefix: tokens in each shared system prompt", group="what is sent"
    )
    time_scale: float = option(
        1.0,
        "trace, mooncake: multiply recorded arrival times (0.5 replays twice as fast)",
        group="what is sent",
    )
    max_input_len: int | None = option(
        None,
        "mooncake: cap on prompt tokens (a longer prompt loses its end)",
        group="what is sent",
    )
    max_output_len: int | None = option(
        None, "mooncake: cap on each request's max_tokens", group="what is sent"
    )
    conversation_sample: float = option(
        1.0,
        "mooncake: replay this share of the trace's conversations, each whole (with "
        "--time-scale below 1, a window spans more of the trace and its turns come back)",
        group="what is sent",
    )
    phases: tuple[Phase, ...] = option(
        Phases(),
        "random prompts whose mix changes: IN:OUT@RATE[/SHARE],... (tokens in, tokens out, "
        "req/s, share of --duration; even shares when none given), e.g. 400:600@8,6000:100@2",
        group="what is sent",
        parse=phases_flag,
    )
    ignore_eos: bool = option(
        False,
        "send ignore_eos with every request (random, shared-prefix, trace and mooncake "
        "requests always do)",
        group="what is sent",
    )

    # Sampling, sent as given (unset: the server's defaults).
    temperature: float | None = option(None, "sampling temperature", group="sampling")
    top_p: float | None = option(None, "nucleus sampling", group="sampling")
    top_k: int | None = option(None, "top-k sampling", group="sampling")
    min_p: float | None = option(None, "min-p sampling", group="sampling")

    # How results are judged and shown.
    slo: dict[str, float] = field(
        default_factory=Limits,
        metadata={
            "option": Option(
                "goodput limits, e.g. ttft=200ms,tpot=50ms,e2e=2s",
                group="how results are judged",
                parse=slo_flag,
            )
        },
    )  # metric -> limit in seconds
    request_timeout_s: float = option(
        600.0,
        "seconds before one request counts as failed",
        flag="--timeout",
        group="how results are judged",
    )
    # How long a cluster whose /health expects more workers than have joined gets for
    # them before the run is refused (benchmarks/presence.py).
    cluster_wait_s: float = option(
        60.0,
        "seconds a cluster whose /health expects more workers than have joined gets for "
        "them; then the run is refused",
        flag="--wait-for-workers",
        group="how results are judged",
    )
    percentile_metrics: tuple[str, ...] = option(
        Listed(PERCENTILE_METRICS),
        "latencies whose percentiles are reported (of ttft,tpot,itl,e2el)",
        group="how results are judged",
        parse=metric_names,
    )
    metric_percentiles: tuple[float, ...] = option(
        Listed((50.0, 90.0, 99.0)),
        "percentiles reported (printed, and pNN_<metric>_ms in the JSON)",
        group="how results are judged",
        parse=percentiles,
    )
    late_threshold_s: float = 0.010  # a launch later than this counts as "fell behind"
    progress: bool = option(
        True, "a live progress bar (on a terminal)", group="how results are judged"
    )

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        problems: list[str] = []
        if self.endpoint not in ENDPOINT_PATHS:
            problems.append(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if self.dataset not in DATASETS:
            problems.append(f"dataset must be one of {list(DATASETS)}")
        if self.dataset in ("jsonl", *TRACE_DATASETS) and not self.dataset_path:
            problems.append(f"dataset {self.dataset!r} needs a dataset path")
        if not self.request_rate > 0:
            problems.append("request rate must be > 0 (inf sends everything at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            problems.append("burstiness must be a positive number")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append("max concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            problems.append("num requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            problems.append("duration must be > 0")
        if self.warmup < 0:
            problems.append("warmup must be >= 0")
        if self.input_len < 1 or self.output_len < 1:
            problems.append("input and output lengths must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            problems.append("range ratio must be in [0, 1)")
        if self.num_groups < 1 or self.prefix_len < 1:
            problems.append("num groups and prefix length must be >= 1")
        if not self.time_scale > 0:
            problems.append("time scale must be > 0")
        if not 0 < self.conversation_sample <= 1:
            problems.append("conversation sample must be in (0, 1]")
        elif self.conversation_sample < 1 and self.dataset != "mooncake":
            problems.append("conversation sample is for --dataset mooncake")
        for name in ("max_input_len", "max_output_len"):
            value = getattr(self, name)
            if value is not None and (value < 1 or self.dataset != "mooncake"):
                problems.append(f"{name.replace('_', ' ')} is for --dataset mooncake, >= 1")
        if self.temperature is not None and not self.temperature >= 0:
            problems.append("temperature must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append("top p must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            problems.append("min p must be in [0, 1]")
        if not set(self.percentile_metrics) <= set(PERCENTILE_METRICS):
            problems.append(f"percentile metrics must be of {list(PERCENTILE_METRICS)}")
        if not all(0 < p <= 100 for p in self.metric_percentiles):
            problems.append("metric percentiles must be in (0, 100]")
        if not self.request_timeout_s > 0:
            problems.append("request timeout must be > 0")
        if not self.cluster_wait_s >= 0:
            problems.append("the wait for workers must be >= 0")
        unknown = set(self.slo) - set(SLO_METRICS)
        if unknown:
            problems.append(f"unknown SLO metrics {sorted(unknown)}; known: {list(SLO_METRICS)}")
        if self.dataset in TRACE_DATASETS and math.isfinite(self.request_rate):
            problems.append(
                f"a {self.dataset} trace sends at its recorded times: the request rate does "
                "not apply (--time-scale speeds it up or slows it down)"
            )
        if self.phases:
            problems += _phase_problems(self)
        unbounded = self.num_requests is None and self.duration_s is not None
        paced = self.dataset in TRACE_DATASETS or bool(self.phases)
        if unbounded and math.isinf(self.request_rate) and not paced:
            problems.append(
                "an infinite request rate with only --duration is unbounded: "
                "give --num-requests too"
            )
        if problems:
            raise BenchConfigError("; ".join(problems))

    @property
    def planned_requests(self) -> int | None:
        """Requests to schedule, warmup included; None when only the duration bounds the run."""
        if self.num_requests is None and self.duration_s is None:
            return self.warmup + DEFAULT_NUM_REQUESTS
        if self.num_requests is None:
            return None
        return self.warmup + self.num_requests

    @property
    def sampling(self) -> dict[str, float | int]:
        """The sampling fields to send: those given."""
        names = ("temperature", "top_p", "top_k", "min_p")
        return {n: v for n in names if (v := getattr(self, n)) is not None}

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def describe(self) -> dict[str, object]:
        """The settings as plain JSON-ready values (no secrets)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "api_key":
                value = "***" if value else None
            out[name] = dict(value) if isinstance(value, dict) else value
        out["phases"] = str(self.phases) if self.phases else None
        return out


def _phase_problems(config: BenchConfig) -> list[str]:
    """What a run of --phases cannot have: its phases give the rates, lengths and times."""
    problems = []
    if config.duration_s is None or config.num_requests is not None:
        problems.append("--phases are shares of --duration: give it, without --num-requests")
    if config.dataset != "random":
        problems.append("--phases make random prompts: not with --dataset " + config.dataset)
    if math.isfinite(config.request_rate):
        problems.append("--phases give each phase's rate: not with --request-rate")
    if config.warmup:
        problems.append("--phases have no warmup requests: leave --warmup at 0")
    return problems


@dataclass(frozen=True)
class ResultFiles:
    """Where `bench serve` writes its results JSON (the sweep writes its own)."""

    out: Path | None = option(None, "write results JSON here", group="results")
    save_result: bool = option(
        False,
        "write results JSON into --result-dir (vLLM's flag; --out names a file)",
        group="results",
    )
    result_dir: Path = option(Path("."), "for --save-result", group="results")
    result_filename: str | None = option(
        None,
        "for --save-result (default: <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json)",
        group="results",
    )
    plots: Path | None = option(
        None,
        "write the run's plots (latency CDFs, throughput over time; needs matplotlib) "
        "into this folder (default: beside the results JSON, when one is written)",
        group="results",
    )
    label: str | None = option(
        None, "names the result (default: the API: openai or openai-chat)", group="results"
    )
    save_detailed: bool = option(
        False,
        "add vLLM's per-request lists (input_lens, output_lens, ttfts, itls, errors) to the "
        "JSON; its per-request records are always there",
        group="results",
    )
