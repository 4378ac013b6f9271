"""Per-request metrics and their aggregates: pure arithmetic over measurements.

Every latency is measured from the request's SCHEDULED send time (or, under
`--max-concurrency`, from the moment it got a slot), not from when the client managed
to send it: a client that falls behind must not make the server look faster.

    scheduled        first content chunk        chunk k        last chunk
        |------ TTFT ------|---- ITL ----|-- ... --|---- ITL ----|
        |------------------------------ E2E -------------------------|
    TPOT = (E2E - TTFT) / (output_tokens - 1)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from baton.benchmarks.client import Measurement
from baton.benchmarks.datasets import BenchRequest

# The server-side breakdown the router reports in `baton_timings`, in display order: the
# phases up to the first token add up to the router's TTFT (services/router/attempt.py).
TTFT_PHASES = (
    "router_queue",
    "ingress",
    "prefill_queue",
    "prefill_compute",
    "first_token_delivery",
    "first_text_wait",
)
# and `ttft_rest`, measured here: the client's TTFT less those phases (router -> client)
SERVER_TIMING_FIELDS = (*TTFT_PHASES, "kv_transfer", "decode_admission", "ttft_rest")
# a prediction, not a phase: held against the phases per placement kind (`PlacementUse`)
PREDICTED_TTFT = "predicted_ttft"
MAX_ERROR_SAMPLES = 5


@dataclass
class RequestRecord:
    """One scheduled request. Times in seconds; offsets are from the run's start."""

    index: int
    warmup: bool
    scheduled_s: float
    sent: bool = True  # False: a concurrency slot freed only after --duration
    success: bool = False
    error: str | None = None
    launch_lag_s: float = 0.0  # how much later than scheduled the client launched it
    client_queue_s: float = 0.0  # waited for a --max-concurrency slot (before the clock)
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # the server's count (usage), when it sent one
    cached_tokens: int | None = None  # of them, found in the server's prefix cache
    expected_input_len: int | None = None
    expected_output_len: int = 0
    finished_s: float | None = None
    server_timings: dict[str, float] | None = None
    placement: str | None = None  # baton's placement of its prefill, when told
    placement_reason: str | None = None  # and why (the cost model's figures), when told
    handed_back_by: str | None = None  # the decode worker that handed its prompt back first

    @property
    def input_tokens(self) -> int:
        """Prompt tokens for throughput: the server's count, else the dataset's estimate."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return self.expected_input_len or 0


def make_record(
    index: int,
    request: BenchRequest,
    *,
    warmup: bool,
    scheduled_s: float,
    run_start: float,
    clock_start: float,
    launch_lag_s: float,
    client_queue_s: float,
    m: Measurement,
) -> RequestRecord:
    """Turn a measurement into metrics. `run_start`, `clock_start`: perf_counter instants."""
    record = RequestRecord(
        index=index,
        warmup=warmup,
        scheduled_s=scheduled_s,
        success=m.ok,
        error=m.error,
        launch_lag_s=launch_lag_s,
        client_queue_s=client_queue_s,
        prompt_tokens=m.prompt_tokens,
        cached_tokens=m.cached_tokens,
        expected_input_len=request.input_len,
        expected_output_len=request.max_tokens,
        finished_s=m.end_time - run_start,
        server_timings=m.server_timings,
        placement=m.placement,
        placement_reason=m.placement_reason,
        handed_back_by=m.handed_back_by,
    )
    if not m.ok:
        return record
    times = m.content_times
    record.ttft_s = times[0] - clock_start
    record.e2e_s = m.end_time - clock_start
    record.itl_s = [later - earlier for earlier, later in itertools.pairwise(times)]
    record.output_tokens = (
        m.completion_tokens if m.completion_tokens is not None else len(m.content_times)
    )
    if record.output_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)
    return record


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Succeeded within every limit. A one-token answer has no TPOT and cannot break it."""
    if not record.success:
        return False
    observed = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    for name, limit in slo.items():
        value = observed[name]
        if value is not None and value > limit:
            return False
    return True


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Stats | None:
        if not values:
            return None
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(array, [50, 90, 99])
        return cls(
            len(values), float(array.mean()), float(p50), float(p90), float(p99), float(array.max())
        )


@dataclass(frozen=True)
class PlacementUse:
    """The completed requests baton placed one way (`baton_timings.placement`)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int | None  # None when the server did not say
    prefill_tokens: int | None  # prompt tokens computed (not cached)
    # the router's TTFT (its phases up to the first token; first_text_wait aside) less the
    # cost placement's prediction (`baton_timings.predicted_ttft`), over the requests it
    # predicted; None when it predicted none
    ttft_error: Stats | None = None
    # of them, placed so after a decode worker handed their prompt back unstarted (placed
    # local there, it could not start in time: `baton_timings.handed_back_by`)
    handed_back: int = 0


@dataclass
class Summary:
    """Aggregates over the measured requests (warmup excluded). Times in seconds."""

    scheduled: int  # every request of the schedule, warmup included
    measured: int  # sent and not warmup
    completed: int
    failed: int
    not_sent: int
    duration_s: float  # first measured scheduled time -> last measured completion
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    goodput: float  # measured requests/s meeting every SLO (all successes if none given)
    slo: dict[str, float]
    slo_attainment: float | None  # fraction of measured requests meeting every SLO
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    # Prompt tokens the server found cached and the share they make of the prompt tokens
    # of the requests that reported it; None when none did.
    cached_prompt_tokens: int | None
    cache_hit_ratio: float | None
    prefill_tokens: int | None  # prompt tokens the server computed (not cached)
    server_timings: dict[str, Stats]  # empty when the server sends no `baton_timings`
    placements: dict[str, PlacementUse]  # by kind; empty when the server names none
    late_launches: int  # launched more than the late threshold after their time
    max_launch_lag_s: float
    error_samples: list[str]


def summarize(
    records: list[RequestRecord], slo: dict[str, float], late_threshold_s: float
) -> Summary:
    measured = [r for r in records if r.sent and not r.warmup]
    done = [r for r in measured if r.success]
    failed = [r for r in measured if not r.success]
    finished = [r.finished_s for r in measured if r.finished_s is not None]
    duration = max(finished) - min(r.scheduled_s for r in measured) if finished else 0.0
    good = sum(meets_slo(r, slo) for r in measured)
    lags = [r.launch_lag_s for r in records if r.sent]
    cached, prompt = _cache_use(done)

    def rate(amount: float) -> float:
        return amount / duration if duration > 0 else 0.0

    return Summary(
        scheduled=len(records),
        measured=len(measured),
        completed=len(done),
        failed=len(failed),
        not_sent=sum(not r.sent for r in records),
        duration_s=duration,
        request_throughput=rate(len(done)),
        input_token_throughput=rate(sum(r.input_tokens for r in done)),
        output_token_throughput=rate(sum(r.output_tokens for r in done)),
        goodput=rate(good),
        slo=dict(slo),
        slo_attainment=good / len(measured) if measured else None,
        ttft=Stats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Stats.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Stats.of([gap for r in done for gap in r.itl_s]),
        e2e=Stats.of([r.e2e_s for r in done if r.e2e_s is not None]),
        mean_prompt_tokens=_mean([r.input_tokens for r in done]),
        mean_output_tokens=_mean([r.output_tokens for r in done]),
        cached_prompt_tokens=cached,
        cache_hit_ratio=cached / prompt if cached is not None and prompt else None,
        prefill_tokens=None if cached is None else prompt - cached,
        server_timings=_server_timing_stats(done),
        placements=_placement_use(done),
        late_launches=sum(lag > late_threshold_s for lag in lags),
        max_launch_lag_s=max(lags, default=0.0),
        error_samples=list(dict.fromkeys(r.error or "unknown error" for r in failed))[
            :MAX_ERROR_SAMPLES
        ],
    )


def _cache_use(done: list[RequestRecord]) -> tuple[int | None, int]:
    """(prompt tokens the server's prefix cache served, prompt tokens) over the requests
    whose usage said how many were cached; (None, 0) when none did."""
    told = [r for r in done if r.cached_tokens is not None and r.prompt_tokens is not None]
    if not told:
        return None, 0
    return sum(r.cached_tokens or 0 for r in told), sum(r.prompt_tokens or 0 for r in told)


def _placement_use(done: list[RequestRecord]) -> dict[str, PlacementUse]:
    """Requests, prompt, cached and computed tokens per placement kind, by kind's name."""
    kinds: dict[str, list[RequestRecord]] = {}
    for record in done:
        if record.placement is not None:
            kinds.setdefault(record.placement, []).append(record)
    out = {}
    for kind, records in sorted(kinds.items()):
        cached, prompt = _cache_use(records)
        out[kind] = PlacementUse(
            requests=len(records),
            prompt_tokens=sum(r.input_tokens for r in records),
            cached_tokens=cached,
            prefill_tokens=None if cached is None else prompt - cached,
            ttft_error=Stats.of([e for r in records if (e := _ttft_error(r)) is not None]),
            handed_back=sum(1 for r in records if r.handed_back_by),
        )
    return out


def _ttft_error(record: RequestRecord) -> float | None:
    """The router's TTFT less the cost placement's prediction of it, if it made one."""
    timings = record.server_timings or {}
    predicted = timings.get(PREDICTED_TTFT, 0.0)
    if predicted <= 0:
        return None
    routed = sum(timings.get(name, 0.0) for name in TTFT_PHASES if name != "first_text_wait")
    return routed - predicted


def _server_timing_stats(records: list[RequestRecord]) -> dict[str, Stats]:
    """Stats of each `baton_timings` field: the known ones first, then any extra ones."""
    values: dict[str, list[float]] = {}
    for record in records:
        timings = record.server_timings or {}
        for name, value in timings.items():
            if name != PREDICTED_TTFT:
                values.setdefault(name, []).append(value)
        if record.ttft_s is not None and "router_queue" in timings:
            phases = sum(timings.get(name, 0.0) for name in TTFT_PHASES)
            values.setdefault("ttft_rest", []).append(record.ttft_s - phases)
    order = [n for n in SERVER_TIMING_FIELDS if n in values]
    order += sorted(set(values) - set(SERVER_TIMING_FIELDS))
    return {name: stats for name in order if (stats := Stats.of(values[name])) is not None}


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def flat_keys(
    records: list[RequestRecord],
    summary: Summary,
    metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: tuple[float, ...] = (),
) -> dict[str, float | int | None]:
    """The flat keys vLLM's and SGLang's serving benchmarks write (`mean_ttft_ms`,
    `p99_itl_ms`, `output_throughput`...), so their result readers and plots read ours:
    p90, p95 and p99 of every latency, and `percentiles` of `metrics` (vLLM's
    --percentile-metrics and --metric-percentiles)."""
    done = [r for r in records if r.sent and not r.warmup and r.success]
    out: dict[str, float | int | None] = {
        "completed": summary.completed,
        "failed": summary.failed,
        "duration": summary.duration_s,
        "total_input_tokens": sum(r.input_tokens for r in done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput,
        "input_throughput": summary.input_token_throughput,
        "output_throughput": summary.output_token_throughput,
        "total_token_throughput": summary.input_token_throughput + summary.output_token_throughput,
        "total_cached_tokens": summary.cached_prompt_tokens,
        "cache_hit_ratio": summary.cache_hit_ratio,
        "total_prefill_tokens": summary.prefill_tokens,
    }
    for name, values in latency_series(done).items():
        array = np.asarray(values, dtype=np.float64) * 1000.0
        empty = array.size == 0
        out[f"mean_{name}_ms"] = None if empty else float(array.mean())
        out[f"median_{name}_ms"] = None if empty else float(np.median(array))
        out[f"std_{name}_ms"] = None if empty else float(array.std())
        chosen = percentiles if name in metrics else ()
        for p in sorted({90.0, 95.0, 99.0, *chosen}):
            out[f"p{percentile_name(p)}_{name}_ms"] = (
                None if empty else float(np.percentile(array, p))
            )
    return out


def latency_series(done: list[RequestRecord]) -> dict[str, list[float]]:
    """Each latency of the completed requests in seconds, by vLLM's name (e2el: E2E)."""
    return {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "e2el": [r.e2e_s for r in done if r.e2e_s is not None],
    }


def percentile_name(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": how vLLM spells a percentile in its keys."""
    return str(int(p)) if p == int(p) else str(p)


def detailed_lists(records: list[RequestRecord]) -> dict[str, list[object]]:
    """vLLM's per-request lists (`--save-detailed`) over the measured requests: a failed
    request has 0 for its times and its error (vLLM's "" for none)."""
    measured = [r for r in records if r.sent and not r.warmup]
    return {
        "input_lens": [r.input_tokens for r in measured],
        "output_lens": [r.output_tokens for r in measured],
        "ttfts": [r.ttft_s or 0.0 for r in measured],
        "itls": [list(r.itl_s) for r in measured],
        "errors": [r.error or "" for r in measured],
    }
