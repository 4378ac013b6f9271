"""Settings of one `baton bench serve` run, resolved once from flags or built in Python.

`BenchConfig` is the whole contract between the command line, the sweep and the
benchmark core: the sweep makes one per (cluster, rate) with `dataclasses.replace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
DATASETS = ("random", "shared-prefix", "jsonl", "trace")
SLO_METRICS = ("ttft", "tpot", "e2e")
# Used when neither --num-requests nor --duration bounds the run.
DEFAULT_NUM_REQUESTS = 100


class BenchConfigError(ValueError):
    """A setting, or a combination of settings, that cannot describe a run."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # a key of ENDPOINT_PATHS
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None
    tokenizer: str | None = None  # model folder whose tokenizer counts prompt lengths;
    # None: the folder the server names as the model's `root` in /v1/models

    # When requests are sent.
    request_rate: float = math.inf  # requests/s; inf sends every request at once
    burstiness: float = 1.0  # gamma shape of inter-arrival gaps; 1.0 is Poisson
    max_concurrency: int | None = None  # cap on requests in flight; None: no cap
    num_requests: int | None = None  # measured requests (warmup comes on top)
    duration_s: float | None = None  # no request is sent after this many seconds
    warmup: int = 0  # the first `warmup` requests are sent but not measured
    seed: int = 0

    # What is sent.
    dataset: str = "random"  # one of DATASETS
    dataset_path: str | None = None  # jsonl and trace
    input_len: int = 256  # random: prompt tokens; shared-prefix: tokens after the prefix
    output_len: int = 64  # max_tokens (random, shared-prefix; jsonl lines without one)
    range_ratio: float = 0.0  # lengths drawn uniformly from len * [1 - r, 1 + r]
    num_groups: int = 8  # shared-prefix: distinct shared system prompts
    prefix_len: int = 512  # shared-prefix: tokens in each shared system prompt
    time_scale: float = 1.0  # trace: recorded gaps are multiplied by this

    # How results are judged and shown.
    slo: dict[str, float] = field(default_factory=dict)  # metric -> limit in seconds
    request_timeout_s: float = 600.0
    # How long a cluster whose /health expects more workers than have joined gets for
    # them before the run is refused (benchmarks/presence.py).
    cluster_wait_s: float = 60.0
    late_threshold_s: float = 0.010  # a launch later than this counts as "fell behind"
    progress: bool = True

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        problems: list[str] = []
        if self.endpoint not in ENDPOINT_PATHS:
            problems.append(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}")
        if self.dataset not in DATASETS:
            problems.append(f"dataset must be one of {list(DATASETS)}")
        if self.dataset in ("jsonl", "trace") and not self.dataset_path:
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
        if not self.request_timeout_s > 0:
            problems.append("request timeout must be > 0")
        if not self.cluster_wait_s >= 0:
            problems.append("the wait for workers must be >= 0")
        unknown = set(self.slo) - set(SLO_METRICS)
        if unknown:
            problems.append(f"unknown SLO metrics {sorted(unknown)}; known: {list(SLO_METRICS)}")
        unbounded = self.num_requests is None and self.duration_s is not None
        if unbounded and math.isinf(self.request_rate) and self.dataset != "trace":
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
        return out
