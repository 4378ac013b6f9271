"""`baton top`'s frame: rates between scrapes, windowed percentiles, the text it prints."""

from __future__ import annotations

from baton.services.top import Scrape, parse, plain_text, view


def _exposition(ttft_counts: tuple[int, int, int], prompt: int, generated: int) -> str:
    """Router and federated worker series as the router's /metrics spells them; the TTFT
    histogram has buckets 0.1, 0.5 and +Inf with these cumulative counts."""
    le01, le05, inf = ttft_counts
    ttft = "baton_router_time_to_first_token_seconds"
    return f"""\
# TYPE {ttft} histogram
{ttft}_bucket{{endpoint="/v1/completions",le="0.1",model_name="m"}} {le01}
{ttft}_bucket{{endpoint="/v1/completions",le="0.5",model_name="m"}} {le05}
{ttft}_bucket{{endpoint="/v1/completions",le="+Inf",model_name="m"}} {inf}
{ttft}_count{{endpoint="/v1/completions",model_name="m"}} {inf}
{ttft}_sum{{endpoint="/v1/completions",model_name="m"}} 1.0
# TYPE baton_router_requests_in_flight gauge
baton_router_requests_in_flight{{model_name="m"}} 3
# TYPE baton_router_requests_queued gauge
baton_router_requests_queued 1
# TYPE baton_worker_info gauge
baton_worker_info{{role="decode",worker_id="decode-0"}} 1
baton_worker_info{{role="prefill",worker_id="prefill-0"}} 1
# TYPE baton_worker_running gauge
baton_worker_running{{role="decode",worker_id="decode-0"}} 2
baton_worker_running{{role="prefill",worker_id="prefill-0"}} 0
# TYPE baton_worker_queued gauge
baton_worker_queued{{role="decode",worker_id="decode-0"}} 1
baton_worker_queued{{role="prefill",worker_id="prefill-0"}} 0
# TYPE baton_worker_token_usage gauge
baton_worker_token_usage{{role="decode",worker_id="decode-0"}} 0.25
baton_worker_token_usage{{role="prefill",worker_id="prefill-0"}} 0.0
# TYPE baton_worker_prompt_tokens counter
baton_worker_prompt_tokens_total{{role="prefill",worker_id="prefill-0"}} {prompt}
# TYPE baton_worker_generation_tokens counter
baton_worker_generation_tokens_total{{role="decode",worker_id="decode-0"}} {generated}
"""


def _scrape(at: float, *args: int, **kw: int) -> Scrape:
    text = _exposition(*args, **kw)  # type: ignore[arg-type]
    return Scrape(at, "ok", ("decode-0", "prefill-0", "prefill-1"), parse(text))


def test_rates_and_percentiles_cover_the_window_not_the_history_before_it() -> None:
    # Before the window: 100 fast requests. In it: 10 more, all between 0.1 and 0.5 s.
    old = _scrape(10.0, (100, 100, 100), prompt=1000, generated=50)
    new = _scrape(12.0, (100, 110, 110), prompt=1400, generated=250)
    frame = view([old, new])
    assert frame.window == "last 2s"
    p50, p99 = frame.ttft
    assert p50 is not None and p99 is not None
    assert abs(p50 - 0.3) < 1e-9 and abs(p99 - 0.496) < 1e-9  # interpolated in (0.1, 0.5]
    decode, prefill, missing = frame.workers
    assert (prefill.tokens_in, decode.tokens_out) == (200.0, 100.0)
    assert (decode.running, decode.queued, decode.kv_usage) == (2, 1, 0.25)
    # Joined (in /health) but its metrics did not come: shown, and unknown.
    assert (missing.worker_id, missing.role, missing.running) == ("prefill-1", "?", None)
    # Since start: the fast history dominates the median.
    assert view([old, new], since_start=True).ttft[0] == 0.1 * 55 / 100


def test_one_scrape_has_no_rates_and_an_empty_histogram_no_percentile() -> None:
    frame = view([_scrape(1.0, (0, 0, 0), prompt=0, generated=0)])
    assert frame.requests_per_s is None and frame.workers[0].tokens_out is None
    assert frame.ttft == (None, None) and frame.window == "since start"


def test_the_text_an_operator_reads() -> None:
    old = _scrape(10.0, (100, 100, 100), prompt=1000, generated=50)
    new = _scrape(12.0, (100, 110, 110), prompt=1400, generated=250)
    assert plain_text(view([old, new])).splitlines() == [
        "cluster ok   in flight 3   queued 1   requests/s 0.0",
        "TTFT p50 300ms  p99 496ms   TPOT p50 -  p99 -   (last 2s)",
        "worker     role     running  queued  KV use  tok/s in  tok/s out",
        "decode-0   decode         2       1     25%       0.0      100.0",
        "prefill-0  prefill        0       0      0%     200.0        0.0",
        "prefill-1  ?              -       -       -         -          -",
    ]
