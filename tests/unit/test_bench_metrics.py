"""Per-request metrics, aggregates, SLOs and response parsing of `baton bench serve`."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from baton.benchmarks.client import (
    Measurement,
    build_payload,
    open_session,
    parse_response_object,
    send,
)
from baton.benchmarks.datasets import BenchRequest
from baton.benchmarks.flags import parse_slo
from baton.benchmarks.metrics import (
    RequestRecord,
    make_record,
    meets_slo,
    summarize,
)

REQUEST = BenchRequest("a b c", max_tokens=5, input_len=3)


def test_parse_slo_understands_ms_and_s() -> None:
    assert parse_slo("ttft=200ms,tpot=50ms,e2e=2s") == {"ttft": 0.2, "tpot": 0.05, "e2e": 2.0}
    assert parse_slo(" e2e = 1.5s ") == {"e2e": 1.5}
    assert parse_slo("") == {}


@pytest.mark.parametrize("bad", ["ttft=200", "ttft=fast", "latency=2s", "ttft=2min"])
def test_parse_slo_rejects_what_it_cannot_read(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(bad)


def measurement(chunks: list[float], end: float, completion_tokens: int | None) -> Measurement:
    return Measurement(
        ok=True,
        content_times=chunks,
        end_time=end,
        prompt_tokens=3,
        completion_tokens=completion_tokens,
        server_timings={"kv_transfer": 0.004},
    )


def record_for(m: Measurement, clock_start: float = 10.0) -> RequestRecord:
    return make_record(
        0,
        REQUEST,
        warmup=False,
        scheduled_s=1.0,
        run_start=9.0,
        clock_start=clock_start,
        launch_lag_s=0.0,
        client_queue_s=0.0,
        m=m,
    )


def test_latencies_count_from_the_scheduled_time() -> None:
    r = record_for(measurement([10.3, 10.4, 10.6], end=10.7, completion_tokens=5))
    assert r.ttft_s == pytest.approx(0.3)
    assert r.e2e_s == pytest.approx(0.7)
    assert r.itl_s == pytest.approx([0.1, 0.2])
    # The server's usage wins over the number of chunks (a chunk may hold several tokens).
    assert r.output_tokens == 5
    assert r.tpot_s == pytest.approx((0.7 - 0.3) / 4)
    assert r.finished_s == pytest.approx(1.7)
    assert r.server_timings == {"kv_transfer": 0.004}


def test_output_tokens_fall_back_to_counted_chunks() -> None:
    r = record_for(measurement([10.1, 10.2], end=10.2, completion_tokens=None))
    assert r.output_tokens == 2


def test_one_token_answer_has_no_tpot_and_cannot_break_it() -> None:
    r = record_for(measurement([10.1], end=10.1, completion_tokens=1))
    assert r.tpot_s is None
    assert meets_slo(r, {"tpot": 0.001, "ttft": 0.2})
    assert not meets_slo(r, {"ttft": 0.05})


def test_failed_request_meets_no_slo() -> None:
    r = record_for(Measurement(ok=False, error="HTTP 500: boom", end_time=10.5))
    assert not r.success and r.ttft_s is None
    assert not meets_slo(r, {})


def test_summary_excludes_warmup_and_counts_goodput() -> None:
    fast = measurement([10.1, 10.2], end=10.3, completion_tokens=2)
    slow = measurement([11.0, 11.1], end=11.2, completion_tokens=2)
    records = [record_for(fast), record_for(fast), record_for(slow)]
    records.append(record_for(Measurement(error="HTTP 503: busy", end_time=10.2)))
    records[0].warmup = True
    records[0].ttft_s = 999.0  # must not show up anywhere
    s = summarize(records, {"ttft": 0.5}, late_threshold_s=0.01)
    assert (s.scheduled, s.measured, s.completed, s.failed) == (4, 3, 2, 1)
    assert s.ttft is not None and s.ttft.max == pytest.approx(1.0)
    assert s.duration_s == pytest.approx(2.2 - 1.0)
    assert s.goodput == pytest.approx(1 / 1.2)
    assert s.request_throughput == pytest.approx(2 / 1.2)
    assert s.output_token_throughput == pytest.approx(4 / 1.2)
    assert s.slo_attainment == pytest.approx(1 / 3)
    assert s.error_samples == ["HTTP 503: busy"]
    assert list(s.server_timings) == ["kv_transfer"]


def test_launches_later_than_the_threshold_are_counted() -> None:
    records = [record_for(measurement([10.1], 10.2, 1)) for _ in range(3)]
    records[1].launch_lag_s = 0.05
    s = summarize(records, {}, late_threshold_s=0.01)
    assert s.late_launches == 1 and s.max_launch_lag_s == pytest.approx(0.05)


def test_parse_completion_chat_and_error_objects() -> None:
    text = parse_response_object({"choices": [{"index": 0, "text": "hi"}]})
    assert text.content == "hi" and text.error is None
    delta = parse_response_object({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert delta.content == ""
    body = parse_response_object(
        {
            "choices": [{"message": {"content": "whole"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "baton_timings": {"router_queue": 0.001, "note": "ignored", "bad": True},
        }
    )
    assert body.content == "whole" and body.usage is not None
    assert body.timings == {"router_queue": 0.001}
    assert parse_response_object({"error": {"message": "no"}}).error is not None
    assert parse_response_object([1, 2]).error is not None


def test_payloads_for_both_endpoints() -> None:
    request = BenchRequest("question", 8, system="shared prefix", ignore_eos=True)
    completion = build_payload(request, "completions", "m")
    assert completion["prompt"] == "shared prefix\n\nquestion"
    assert completion["stream"] and completion["stream_options"] == {"include_usage": True}
    assert completion["ignore_eos"] and completion["max_tokens"] == 8
    chat = build_payload(request, "chat", "m")
    assert chat["messages"] == [
        {"role": "system", "content": "shared prefix"},
        {"role": "user", "content": "question"},
    ]
    assert "ignore_eos" not in build_payload(BenchRequest("q", 8), "chat", "m")


def test_cache_use_and_placements_are_summed_as_the_server_reported_them() -> None:
    """The hit ratio is the server's cached tokens over its prompt tokens, and a run on
    baton splits prompt, cached and computed tokens by where each request was prefilled."""
    usage = {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 600}}
    why = "cost 0.120s: 600 of 1000 tokens cached on D"
    timings = {"placement": "local", "placement_reason": why, "x": 1}
    info = parse_response_object({"choices": [], "usage": usage, "baton_timings": timings})
    assert info.placement == "local" and info.timings == {"x": 1.0}
    assert info.placement_reason == why  # each run's records keep the cost model's figures
    aggregated = parse_response_object({"choices": [], "baton_timings": {"placement": ""}})
    assert aggregated.placement == "aggregated"

    def done(index: int, prompt: int, cached: int | None, placement: str | None) -> RequestRecord:
        m = measurement([1.0, 1.1], 1.2, 2)
        m.prompt_tokens, m.cached_tokens, m.placement = prompt, cached, placement
        return make_record(
            index, REQUEST, warmup=False, scheduled_s=0.0, run_start=0.0, clock_start=0.5,
            launch_lag_s=0.0, client_queue_s=0.0, m=m,
        )  # fmt: skip

    records = [
        done(0, 1000, 600, "local"),
        done(1, 3000, 0, "disagg-full"),
        done(2, 1000, 900, "local"),
        done(3, 500, None, None),  # a server that does not say: left out of the ratio
    ]
    s = summarize(records, {}, 0.01)
    assert (s.cached_prompt_tokens, s.prefill_tokens) == (1500, 3500)
    assert s.cache_hit_ratio == pytest.approx(1500 / 5000)
    assert set(s.placements) == {"local", "disagg-full"}
    local = s.placements["local"]
    assert (local.requests, local.prompt_tokens, local.cached_tokens) == (2, 2000, 1500)
    assert local.prefill_tokens == 500 and s.placements["disagg-full"].prefill_tokens == 3000
    untold = summarize(records[3:], {}, 0.01)
    assert untold.cache_hit_ratio is None and untold.placements == {}


def test_the_cost_models_ttft_prediction_is_held_against_the_routers_ttft() -> None:
    """Per placement kind: the router's phases up to the first token (the text's wait
    aside) less `baton_timings.predicted_ttft`, over the requests it predicted; the sweep
    report tabulates it per run."""
    from rich.console import Console

    from baton.benchmarks.report import placement_table
    from baton.benchmarks.sweep_config import SweepPoint
    from baton.benchmarks.sweep_report import _predictions_table

    def done(index: int, placement: str, predicted: float, phases: float) -> RequestRecord:
        m = measurement([1.0, 1.1], 1.2, 2)
        m.placement = placement
        m.server_timings = {
            "router_queue": 0.01, "prefill_compute": phases - 0.01,
            "first_text_wait": 0.5, "predicted_ttft": predicted,
        }  # fmt: skip
        return make_record(
            index, REQUEST, warmup=False, scheduled_s=0.0, run_start=0.0, clock_start=0.5,
            launch_lag_s=0.0, client_queue_s=0.0, m=m,
        )  # fmt: skip

    records = [
        done(0, "local", 0.05, 0.15),
        done(1, "local", 0.10, 0.12),
        done(2, "disagg-full", 0.30, 0.25),
        done(3, "disagg-full", 0.0, 0.40),  # placed without a prediction: not counted
    ]
    s = summarize(records, {}, 0.01)
    local, full = s.placements["local"].ttft_error, s.placements["disagg-full"].ttft_error
    assert local is not None and full is not None
    assert (local.count, full.count) == (2, 1)
    assert local.max == pytest.approx(0.10) and full.p50 == pytest.approx(-0.05)
    assert "predicted_ttft" not in s.server_timings  # a prediction, not a phase
    table = "\n".join(_predictions_table([SweepPoint("1P1D@cost", 2, 8.0, s)]))
    assert "| 1P1D@cost | 8 | disagg-full | 1 | -50 | -50 | -50 |" in table
    console = Console(record=True, width=200)  # and `bench serve` prints it per kind
    console.print(placement_table(s))
    printed = console.export_text()
    assert "TTFT - predicted p50" in printed and "-50" in printed and "+60" in printed


def test_prompts_a_decode_worker_handed_back_are_counted_in_the_kind_they_ended_in() -> None:
    """A local prompt its D could not start in time is placed again (through P): the
    answer names that D (`baton_timings.handed_back_by`), and the run counts it under the
    kind it was served by, in `bench serve`'s table and the sweep's."""
    from rich.console import Console

    from baton.benchmarks.report import placement_table
    from baton.benchmarks.sweep_config import SweepPoint
    from baton.benchmarks.sweep_report import _placements_table

    timings = {"placement": "disagg-full", "handed_back_by": "decode-0", "router_queue": 0.3}
    info = parse_response_object({"choices": [], "baton_timings": timings})
    assert info.handed_back_by == "decode-0" and info.timings == {"router_queue": 0.3}
    assert parse_response_object({"choices": [], "baton_timings": {}}).handed_back_by is None

    def done(index: int, placement: str, handed_back_by: str | None) -> RequestRecord:
        m = measurement([1.0, 1.1], 1.2, 2)
        m.placement, m.handed_back_by = placement, handed_back_by
        return make_record(
            index, REQUEST, warmup=False, scheduled_s=0.0, run_start=0.0, clock_start=0.5,
            launch_lag_s=0.0, client_queue_s=0.0, m=m,
        )  # fmt: skip

    records = [done(0, "disagg-full", "decode-0"), done(1, "disagg-full", None)]
    records += [done(2, "local", None), done(3, "disagg-full", "decode-1")]
    s = summarize(records, {}, 0.01)
    assert s.placements["disagg-full"].handed_back == 2 and s.placements["local"].handed_back == 0
    table = "\n".join(_placements_table([SweepPoint("1P2D@cost", 3, 8.0, s)]))
    assert "| shape | rate | disagg-full | local | handed back |" in table
    assert "| 1P2D@cost | 8 | 3 | 1 | 2 |" in table
    quiet = summarize(records[1:3], {}, 0.01)  # none handed back: no column
    assert "handed back" not in "\n".join(
        _placements_table([SweepPoint("1P2D@cost", 3, 8.0, quiet)])
    )
    console = Console(record=True, width=200)
    console.print(placement_table(s))
    assert "handed back" in console.export_text()


def _stream(*chunks: dict) -> bytes:
    return ("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n").encode()


async def _send(
    body: bytes, content_type: str = "text/event-stream", status: int = 200
) -> Measurement:
    """`send` against a local server that answers `body`, in pieces of 7 bytes (events
    and lines split across reads)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"content-type": content_type})
        await response.prepare(request)
        for i in range(0, len(body), 7):
            await response.write(body[i : i + 7])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    async with TestServer(app) as server, open_session({}, 10.0) as session:
        return await send(session, str(server.make_url("/v1/completions")), b"{}")


def test_an_answer_of_tokens_without_text_is_served_not_failed() -> None:
    # A one-token answer whose token reads as no text (a special token, a partial
    # character): the Mooncake replay on 4x H100 counted 2-4 such answers a run as failed.
    m = asyncio.run(
        _send(
            _stream(
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}},
            )
        )
    )
    assert m.ok and m.error is None and len(m.content_times) == 1


def test_a_stream_that_ends_without_tokens_or_finish_still_fails() -> None:
    m = asyncio.run(_send(_stream({"choices": [], "usage": {"prompt_tokens": 9}})))
    assert not m.ok and m.error == "response ended without any content"


def test_each_streamed_chunk_with_text_is_timed_however_the_reads_split_it() -> None:
    long_text = "x" * 400_000  # one event past aiohttp's own line buffer (256 KiB)
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b", long_text)]
    usage = {"prompt_tokens": 9, "completion_tokens": 3}
    m = asyncio.run(_send(_stream(*chunks, {"choices": [], "usage": usage})))
    assert m.ok and len(m.content_times) == 3 and m.completion_tokens == 3


def test_an_http_error_is_the_measurement_with_its_body_capped() -> None:
    m = asyncio.run(_send(b'{"error": "' + b"y" * 10_000 + b'"}', "application/json", 400))
    assert not m.ok and m.error is not None and m.error.startswith('HTTP 400: {"error": "yyy')
    assert len(m.error) < 2_100


def test_a_whole_body_answer_is_read_as_one_chunk() -> None:
    body = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}
    m = asyncio.run(_send(json.dumps(body).encode(), "application/json"))
    assert m.ok and len(m.content_times) == 1


def test_a_refused_connection_is_a_failed_measurement() -> None:
    async def refused() -> Measurement:
        async with open_session({}, 5.0) as session:
            return await send(session, "http://127.0.0.1:9/v1/completions", b"{}")

    m = asyncio.run(refused())
    assert not m.ok and m.error is not None and "Connect" in m.error
