"""`baton top --url ROUTER`: the cluster at a glance, refreshed every second.

Everything comes from the router's `/health` (who has joined) and `/metrics` (the
router's series and every worker's, federated with `worker_id` and `role` labels), the
endpoints Prometheus and load balancers already read (with the API key, when the router
wants one for /metrics), so top adds no endpoint and no load a scraper would not. Rates are the growth of counters between scrapes; latency
percentiles come from the router's histograms, as the growth of their buckets over the
window top has watched (at most the last minute), interpolated within a bucket the way
Prometheus' `histogram_quantile` does. `--once` prints one frame for scripts: rates over
one interval, percentiles since the router started.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from baton.common.options import secret

WINDOW_S = 60.0  # the percentiles' window once top has watched that long

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    parser.add_argument(
        "--api-key",
        type=secret,
        default=None,
        help="the router's API key, which /metrics needs unless the router runs with "
        "--metrics-public (prefer the environment variable: argv is visible to local users)",
    )
    parser.add_argument(
        "--once", action="store_true", help="print one frame as plain text and exit"
    )


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        print("baton top: error: argument --interval: must be > 0")
        return 2
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(timeout=5.0, trust_env=False, headers=headers) as client:
        try:
            if args.once:
                first = scrape(client, url)
                time.sleep(args.interval)
                frame = view([first, scrape(client, url)], since_start=True)
                print(plain_text(frame), end="")
                return 0
            return _live(client, url, args.interval)
        except httpx.HTTPError as e:
            print(f"baton top: cannot read {url}: {e}")
            return 1


def _live(client: httpx.Client, url: str, interval: float) -> int:
    from rich.live import Live

    history: deque[Scrape] = deque()
    with Live(auto_refresh=False, screen=False) as live:
        try:
            while True:
                try:
                    history.append(scrape(client, url))
                except httpx.HTTPError as e:  # a router restarting: say so, keep trying
                    live.update(Text(f"cannot read {url}: {e} (retrying)"))
                else:
                    while history[-1].at - history[0].at > WINDOW_S:
                        history.popleft()
                    live.update(render(view(list(history), since_start=len(history) == 1)))
                live.refresh()
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0


@dataclass(frozen=True)
class Scrape:
    at: float  # time.monotonic() when read
    status: str  # /health's status: ok, partial, unavailable
    worker_ids: tuple[str, ...]  # joined, by /health
    samples: Samples


def scrape(client: httpx.Client, url: str) -> Scrape:
    health = client.get(url + "/health")  # 503 while unusable still has a body
    metrics = client.get(url + "/metrics")
    metrics.raise_for_status()
    body = health.json()
    worker_ids = tuple(body.get("worker_ids", ()))
    return Scrape(time.monotonic(), body.get("status", "?"), worker_ids, parse(metrics.text))


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    role: str  # "?" for a joined worker whose metrics did not come
    running: float | None
    queued: float | None
    kv_usage: float | None  # fraction of its KV pages in use
    tokens_in: float | None  # prompt tokens a second
    tokens_out: float | None  # generated tokens a second


@dataclass(frozen=True)
class ClusterView:
    status: str
    window: str  # what the percentiles cover: "last 42s" or "since start"
    in_flight: float
    queued: float
    requests_per_s: float | None
    ttft: tuple[float | None, float | None]  # p50, p99 seconds
    tpot: tuple[float | None, float | None]
    workers: tuple[WorkerRow, ...]


def view(history: Sequence[Scrape], since_start: bool = False) -> ClusterView:
    """The frame for `history` (oldest first, at least one scrape)."""
    new = history[-1]
    old = history[0] if len(history) > 1 else None
    base = None if since_start else old
    window = "since start" if base is None else f"last {new.at - base.at:.0f}s"
    elapsed = new.at - old.at if old is not None else 0.0

    def rate(name: str, match: Mapping[str, str]) -> float | None:
        if old is None or elapsed <= 0:
            return None
        grown = _sum(new.samples, name, match) - _sum(old.samples, name, match)
        return max(grown, 0.0) / elapsed

    def quantiles(name: str) -> tuple[float | None, float | None]:
        buckets = _buckets(new.samples, name, base.samples if base else None)
        return histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)

    roles = {
        dict(labels)["worker_id"]: dict(labels).get("role", "?")
        for (name, labels) in new.samples
        if name == "baton_worker_info" and "worker_id" in dict(labels)
    }
    rows = []
    for worker_id in sorted(set(new.worker_ids) | set(roles)):
        mine = {"worker_id": worker_id}
        seen = worker_id in roles

        def gauge(name: str, mine: dict[str, str] = mine, seen: bool = seen) -> float | None:
            return _sum(new.samples, name, mine) if seen else None

        rows.append(
            WorkerRow(
                worker_id,
                roles.get(worker_id, "?"),
                gauge("baton_worker_running"),
                gauge("baton_worker_queued"),
                gauge("baton_worker_token_usage"),
                rate("baton_worker_prompt_tokens_total", mine) if seen else None,
                rate("baton_worker_generation_tokens_total", mine) if seen else None,
            )
        )
    return ClusterView(
        status=new.status,
        window=window,
        in_flight=_sum(new.samples, "baton_router_requests_in_flight", {}),
        queued=_sum(new.samples, "baton_router_requests_queued", {}),
        requests_per_s=rate("baton_router_e2e_request_latency_seconds_count", {}),
        ttft=quantiles("baton_router_time_to_first_token_seconds"),
        tpot=quantiles("baton_router_time_per_output_token_seconds"),
        workers=tuple(rows),
    )


def render(frame: ClusterView) -> Group:
    summary = Text(
        f"cluster {frame.status}   in flight {frame.in_flight:.0f}   queued {frame.queued:.0f}"
        f"   requests/s {_num(frame.requests_per_s, '.1f')}\n"
        f"TTFT p50 {_ms(frame.ttft[0])}  p99 {_ms(frame.ttft[1])}   "
        f"TPOT p50 {_ms(frame.tpot[0])}  p99 {_ms(frame.tpot[1])}   ({frame.window})"
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("worker", "role", "running", "queued", "KV use", "tok/s in", "tok/s out"):
        table.add_column(column, justify="left" if column in ("worker", "role") else "right")
    for w in frame.workers:
        kv = None if w.kv_usage is None else 100 * w.kv_usage
        table.add_row(
            w.worker_id,
            w.role,
            _num(w.running, ".0f"),
            _num(w.queued, ".0f"),
            "-" if kv is None else f"{kv:.0f}%",
            _num(w.tokens_in, ".1f"),
            _num(w.tokens_out, ".1f"),
        )
    return Group(summary, table)


def plain_text(frame: ClusterView, width: int = 120) -> str:
    """The frame as uncoloured text (what `--once` prints)."""
    console = Console(width=width, no_color=True, highlight=False)
    with console.capture() as captured:
        console.print(render(frame))
    return "\n".join(line.rstrip() for line in captured.get().splitlines()) + "\n"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _matches(labels: Labels, match: Mapping[str, str]) -> bool:
    return all((k, v) in labels for k, v in match.items())


def _sum(samples: Samples, name: str, match: Mapping[str, str]) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name and _matches(labels, match))


def _buckets(samples: Samples, name: str, since: Samples | None) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram `name` summed over its label sets,
    less the counts in `since`."""
    counts: dict[float, float] = {}
    for source, sign in ((samples, 1.0), (since or {}, -1.0)):
        for (n, labels), value in source.items():
            if n == name + "_bucket":
                le = float(dict(labels)["le"])
                counts[le] = counts.get(le, 0.0) + sign * value
    return sorted(counts.items())


def histogram_quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets; None when empty."""
    buckets = list(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # above the largest finite bucket: its bound, as Prometheus
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return None
