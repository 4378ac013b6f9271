"""Placement: the threshold rule, the cost model on fixed measurements, and the fits the
router makes from workers' load reports."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from baton.common.engine import Engine
from baton.common.engine import scheduler as scheduler_module
from baton.common.engine.step_clock import SlowStep, StepClock
from baton.common.ratelog import RateLimitedLog
from baton.common.rpc import baton_pb2 as pb
from baton.common.rpc.convert import to_proto
from baton.common.sampling import SamplingParams
from baton.common.step_times import MAX_STALL_SLOS, LinearFit, chunk_pairs
from baton.services.router.measurements import ClusterMeter
from baton.services.router.placement import (
    DELTA,
    FULL,
    LOCAL,
    Cluster,
    Line,
    Slo,
    WorkerState,
    choose_by_cost,
    disagg_estimate,
    local_estimate,
    threshold_says_local,
)

# An 8B-like worker: a prompt step costs 5 ms + 0.05 ms a token (20k tokens/s) + 1.3 ns
# an attention pair (a 12k prompt: 0.6 s + 0.09 s of attention), a decode step 8 ms +
# 0.04 ms a row; KV of 128 KiB a token over a 10 GB/s link.
PREFILL = Line(0.005, 0.00005, 1.3e-9)
DECODE = Line(0.008, 0.00004)
KV_BYTES = 128 * 1024
SLO = Slo(ttft=2.0, tpot=0.02)
# A decode worker's running requests can absorb 3 s of stall: 343-token answers at an
# 8.3 ms step, held to 90% of a 20 ms TPOT, 342 x 18 ms - 343 x 8.3 ms.
SLACK = 3.3


def cluster(
    d_cached: int, p_cached: int = 0, d_running: int = 8, d2_cached: int = 0, slack: float = SLACK
) -> Cluster:
    return Cluster(
        prefills=(WorkerState("p", p_cached, 0, 0, PREFILL, None),),
        decodes=(
            WorkerState("d1", d_cached, d_running, 0, PREFILL, DECODE, slack),
            WorkerState("d2", d2_cached, d_running, 0, PREFILL, DECODE, slack),
        ),
        pairs=frozenset({("p", "d1"), ("p", "d2")}),
        kv_bytes_per_token=KV_BYTES,
        transfer_rate=10e9,
    )


def test_cost_computes_a_mostly_cached_follow_up_turn_on_its_decode_worker() -> None:
    # turn 2 of a chat: 4,000 tokens, of which D1 served (and caches) the first 3,800
    chosen = choose_by_cost(4000, cluster(d_cached=3800), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.decode, chosen.prefill) == (LOCAL, "d1", None)
    assert "3800 of 4000 tokens cached on D" in chosen.reason


def test_a_decode_worker_that_handed_a_prompt_back_is_not_given_it_local_again() -> None:
    c = cluster(d_cached=3800)
    first = choose_by_cost(4000, c, SLO)
    assert first is not None and (first.kind, first.decode) == (LOCAL, "d1")
    assert first.start_within == pytest.approx(0.25 * SLO.ttft)  # then D hands it back
    assert 0 < first.predicted_ttft < SLO.ttft  # (the router reports it per request)
    again = choose_by_cost(4000, c, SLO, no_local=frozenset({"d1"}))
    assert again is not None and (again.kind, again.decode) != (LOCAL, "d1")
    assert again.kind == LOCAL or again.start_within == 0.0  # only local prompts are timed


def test_cost_sends_a_long_new_prompt_to_the_prefill_worker() -> None:
    # a new 12k prompt (the Mooncake conversation trace's mean) beside 8 decoding requests
    chosen = choose_by_cost(12_000, cluster(d_cached=0), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.prefill) == (FULL, "p")
    local = local_estimate(12_000, cluster(d_cached=0).decodes[0], SLO)
    assert local is not None and local.delay_to_others > 0.5  # its streams stall for it


def test_p_queue_is_the_prompts_placed_on_it_each_at_its_own_length() -> None:
    # Mooncake x8 on 2x H200 (session 38): a 22k-token prompt behind two short ones on P
    # was predicted to wait two 22k prefills, past the TTFT SLO, and went local at a cost
    # of seconds to D's streams
    c = cluster(d_cached=0)
    behind_short = replace(c.prefills[0], queued=2, owed_prompts=(400, 500))
    remote = disagg_estimate(22_000, behind_short, c.decodes[0], c)
    alone = disagg_estimate(22_000, c.prefills[0], c.decodes[0], c)
    assert remote is not None and alone is not None
    ahead = PREFILL.chunk(400, 0) + PREFILL.chunk(500, 0)
    assert remote.ttft == pytest.approx(alone.ttft + ahead)
    assert not remote.misses(SLO)
    chosen = choose_by_cost(22_000, replace(c, prefills=(behind_short,)), SLO)
    assert chosen is not None and (chosen.kind, chosen.prefill) == (FULL, "p")
    assert chosen.computes == 22_000  # owed on P until its first token is back
    # and a short prompt behind two long ones waits for both
    behind_long = replace(c.prefills[0], queued=2, owed_prompts=(15_000, 15_000))
    short = disagg_estimate(600, behind_long, c.decodes[0], c)
    assert short is not None and short.ttft > 2 * PREFILL.chunk(15_000, 0)
    # P's queue as it reports it (requests this router did not place): each as long as this
    reported = replace(c.prefills[0], queued=2)
    guessed = disagg_estimate(600, reported, c.decodes[0], c)
    assert guessed is not None and guessed.ttft == pytest.approx(3 * PREFILL.chunk(600, 0))


def test_a_prompt_computed_on_p_decodes_on_the_less_busy_decode_worker() -> None:
    # 2P2D at 52 req/s (4x H200, session 34): P's prompts all went to the first D
    busy = replace(cluster(d_cached=0).decodes[0], running=40, queued=6, slack=0.0)
    idle = replace(cluster(d_cached=0).decodes[1], running=10, slack=0.0)
    for decodes in ((busy, idle), (idle, busy)):
        chosen = choose_by_cost(1330, replace(cluster(d_cached=0), decodes=decodes), SLO)
        assert chosen is not None
        assert (chosen.kind, chosen.decode) == (FULL, "d2")
    # and the rows headed for D (placed, not yet in its batch) count before D reports them
    c = cluster(d_cached=0)
    ahead = replace(idle, running=0, queued=30)
    quiet = replace(idle, running=0, queued=0)
    assert disagg_estimate(1330, c.prefills[0], ahead, c).cost(SLO) > disagg_estimate(
        1330, c.prefills[0], quiet, c
    ).cost(SLO)


def test_cost_computes_a_short_prompt_beside_a_decode_worker_with_slack() -> None:
    # 300 new tokens: one short step on D, no transfer
    chosen = choose_by_cost(300, cluster(d_cached=0), SLO)
    assert chosen is not None and chosen.kind == LOCAL


def test_cost_sends_only_the_missing_pages_to_the_decode_worker_that_holds_a_prefix() -> None:
    # a long new question after a short shared system prompt: P computes it, and the D
    # that holds the system prompt receives only the rest
    chosen = choose_by_cost(8000, cluster(d_cached=0, p_cached=2000, d2_cached=2000), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.decode, chosen.prefill) == (DELTA, "d2", "p")


def test_a_decode_worker_whose_running_requests_have_no_slack_prefills_nothing() -> None:
    spent = WorkerState("d", 3800, running=8, queued=0, prefill=PREFILL, decode=DECODE, slack=0)
    assert local_estimate(4000, spent, SLO) is None
    # 300 running rows: a step of them alone takes 20 ms, their whole decode step and more
    full = WorkerState("d", 3800, running=300, queued=0, prefill=PREFILL, decode=DECODE, slack=0)
    assert local_estimate(4000, full, SLO) is None
    chosen = choose_by_cost(4000, cluster(d_cached=3800, slack=0.0), SLO)
    assert chosen is not None and chosen.kind != LOCAL


def test_local_prefill_is_predicted_in_steps_the_slack_rule_allows() -> None:
    """What D does (`decode_role.prefill_budget`): steps of at most 10 SLOs while the slack
    lasts, then of the decode step plus what is left of it."""
    d = WorkerState("d", 0, running=10, queued=0, prefill=PREFILL, decode=DECODE, slack=SLACK)
    # 12k tokens need about 0.7 s: steps of 0.2 s, each a chunk sized for its context
    estimate = local_estimate(12_000, d, SLO)
    assert estimate is not None
    alone = PREFILL.chunk(12_000, 0)
    steps = 4  # 0.7 s of chunks in steps of 0.2 s
    # each step: the decode step of the 10 rows, and a chunk on top (whose tokens and
    # attention pairs add up to the whole prompt's)
    assert estimate.ttft == pytest.approx(alone - PREFILL.intercept + steps * DECODE.at(10))
    assert MAX_STALL_SLOS * SLO.tpot * (steps - 1) < estimate.ttft
    assert estimate.delay_to_others > 0  # the running requests' streams stalled
    # with 0.3 s of slack, the steps after the first shrink to what is left, and the
    # slack runs out long before 12k tokens are done: D's TPOT would miss
    assert local_estimate(1500, d, SLO) is not None
    tight = WorkerState("d", 0, 10, 0, PREFILL, DECODE, slack=0.3)
    assert local_estimate(12_000, tight, SLO) is None
    small = local_estimate(2000, tight, SLO)
    assert small is not None and small.delay_to_others <= 10 * 0.3


def test_a_chunk_late_in_a_long_prompt_takes_longer_than_the_first() -> None:
    first, late = PREFILL.chunk(2048, 0), PREFILL.chunk(2048, 10_000)
    assert late > first + 0.02  # 2048 x 10k pairs of attention: 27 ms more
    assert PREFILL.largest_chunk(0.2, 10_000) < PREFILL.largest_chunk(0.2, 0)
    n = PREFILL.largest_chunk(0.2, 10_000, rows=8)
    assert PREFILL.chunk(n, 10_000, 8) <= 0.2 < PREFILL.chunk(n + 1, 10_000, 8)


def test_cost_never_picks_local_past_the_ttft_slo_where_disagg_meets_it() -> None:
    # D owes 20 local prompts of 4,000 tokens placed before: local is predicted past 2 s;
    # P, idle, meets it, even though its transfer makes disagg cost more otherwise
    queued = Cluster(
        prefills=(WorkerState("p", 0, 0, 0, PREFILL, None),),
        decodes=(WorkerState("d", 3900, 0, 0, PREFILL, DECODE, SLACK, owed_prompts=(80_000,)),),
        pairs=frozenset({("p", "d")}),
        kv_bytes_per_token=KV_BYTES,
        transfer_rate=10e9,
    )
    chosen = choose_by_cost(4000, queued, SLO)
    assert chosen is not None and chosen.kind == DELTA


def test_a_prompt_a_little_late_on_p_is_not_computed_on_a_full_batchs_slack() -> None:
    # P's queue would answer 2,000 tokens just past a 1 s TTFT SLO; D could compute them
    # in time, but only by spending most of the slack of the 200 streams it decodes: one
    # late first token costs less than 200 streams at the edge of their TPOT
    slo = Slo(ttft=1.0, tpot=0.02)
    d = WorkerState(
        "d", 0, running=200, prefill=PREFILL, decode=DECODE, slack=0.12, slack_tokens=100
    )
    late_p = Cluster(
        prefills=(WorkerState("p", 0, 0, 9, PREFILL, None),),
        decodes=(d,),
        pairs=frozenset({("p", "d")}),
        kv_bytes_per_token=KV_BYTES,
        transfer_rate=10e9,
    )
    local = local_estimate(2000, d, slo)
    remote = disagg_estimate(2000, late_p.prefills[0], d, late_p)
    assert local is not None and not local.misses(slo)
    assert remote is not None and remote.misses(slo)
    chosen = choose_by_cost(2000, late_p, slo)
    assert chosen is not None and chosen.kind == FULL
    # with slack to spare on D, the same prompt is computed there
    roomy = replace(late_p, decodes=(replace(d, running=20, slack=3.0),))
    chosen = choose_by_cost(2000, roomy, slo)
    assert chosen is not None and chosen.kind == LOCAL


def test_cost_falls_back_before_anything_is_measured() -> None:
    unmeasured = Cluster(
        (WorkerState("p"),), (WorkerState("d"),), frozenset({("p", "d")}), KV_BYTES
    )
    assert choose_by_cost(100, unmeasured, SLO) is None


def test_an_unmeasured_decode_worker_borrows_the_prefill_workers_line() -> None:
    measured_p = Cluster(
        (WorkerState("p", 0, 0, 0, PREFILL, None),),
        (WorkerState("d", 3800),),
        frozenset({("p", "d")}),
        KV_BYTES,
    )
    chosen = choose_by_cost(4000, measured_p, SLO)
    assert chosen is not None and chosen.kind == LOCAL


@pytest.mark.parametrize(
    ("prompt", "cached", "local"),
    [
        (4000, 3800, True),  # 200 uncached: short and 5% of the prompt
        (1000, 0, False),  # all of it uncached
        (3000, 1000, True),  # 2,000 uncached: under 2,048, and 67% of the prompt
        (10000, 7900, False),  # 2,100 uncached: too many, though 21%
        (100, 40, True),  # 60 of 100: under 70%
        (100, 30, False),  # 70 of 100: not under 70%
    ],
)
def test_threshold_rule(prompt: int, cached: int, local: bool) -> None:
    assert threshold_says_local(prompt, WorkerState("d", cached)) is local


def test_a_linear_fit_recovers_a_step_line() -> None:
    fit = LinearFit()
    for tokens in (100, 500, 1000, 2000):
        fit.add(tokens, 0.004 + 0.00006 * tokens)
    line = fit.line()
    assert line.intercept == pytest.approx(0.004) and line.slope == pytest.approx(0.00006)
    assert line.attention == 0  # no pairs seen
    assert line.largest_chunk(0.064, 0) == 1000
    one_size = LinearFit()
    one_size.add(100, 0.01)
    assert one_size.line() == Line(0.0, pytest.approx(0.0001))  # proportional


def test_the_fit_learns_the_attention_term_from_chunks_at_different_contexts() -> None:
    fit = LinearFit()
    for context in (0, 4096, 8192):
        for tokens in (512, 2048):
            pairs = chunk_pairs(tokens, context)
            fit.add(tokens, PREFILL.at(tokens, pairs), pairs=pairs)
    line = fit.line()
    assert line.intercept == pytest.approx(PREFILL.intercept)
    assert line.slope == pytest.approx(PREFILL.slope)
    assert line.attention == pytest.approx(PREFILL.attention)
    # a line in tokens alone, fitted on short first chunks, under-predicts a late chunk
    short = LinearFit()
    for tokens in (64, 128):
        short.add(tokens, PREFILL.chunk(tokens, 0), pairs=chunk_pairs(tokens, 0))
    assert short.line().attention == 0
    assert short.predict(2048) < 0.9 * PREFILL.chunk(2048, 10_000)


def test_the_step_clock_tells_prompt_steps_from_decode_steps() -> None:
    clock = StepClock()
    clock.record(tokens=300, rows=3, seconds=0.02, pairs=9e4)  # a chunk, two decode rows along
    clock.record(tokens=8, rows=8, seconds=0.01, pairs=8e3)  # decode rows only
    t = clock.times
    assert (t.prefill_steps, t.prefill_tokens, t.decode_steps, t.decode_rows) == (1, 300, 1, 8)
    assert t.prefill_pairs == 9e4


def test_a_step_far_past_its_fit_is_a_stall_the_scheduler_logs(
    tiny_model: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of 1 s where the worker's prompt steps take 50 ms is reported (a kernel
    compiled for a new shape, a host pause), with how it ran, once fitted; a step the fit expects is not,
    nor a slow one before any fit, nor one under half a second."""
    clock = StepClock()
    assert clock.step_done(2048, 1, time.perf_counter() - 1.0) is None  # nothing fitted yet
    clock = StepClock()
    for _ in range(20):
        clock.record(2048, 1, 0.05)
        clock.record(0, 32, 0.01)  # decode steps of 10 ms
    slow = clock.step_done(2048, 1, time.perf_counter() - 1.0)
    assert slow is not None and slow.seconds >= 1.0 and slow.predicted == pytest.approx(0.05, 0.1)
    assert clock.step_done(2048, 1, time.perf_counter()) is None
    clock._last_end = 0.0
    assert clock.step_done(0, 32, time.perf_counter() - 0.3) is None  # 30x, but 0.3 s
    # the scheduler says so in its log, once a step is that slow (a limiter of its own: an
    # earlier test's stall in this process would hold the line back for ten seconds)
    monkeypatch.setattr(
        scheduler_module, "_stalls", RateLimitedLog(logging.getLogger("baton.scheduler"))
    )
    with Engine(tiny_model, page_size=4) as engine, caplog.at_level(logging.WARNING):
        engine.scheduler.clock.step_done = lambda *a, **k: SlowStep(2048, 1, 1.02, 0.05)  # type: ignore[method-assign]
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
        stalled = engine.scheduler.stats.stalled_steps  # what /metrics counts
    assert "took 1.02 s where this worker's steps predict 0.050 s" in caplog.text
    # with what tells a compile or a pause (the host's part) from a slow device
    assert "(longest context 3, eager)" in caplog.text
    assert "queueing its kernels on the host" in caplog.text
    assert "waiting for the device" in caplog.text
    assert stalled >= 1


def test_a_stalled_step_does_not_hold_the_decode_prediction_high() -> None:
    """As on an H200 (session 32): after the decoders' prompts, one decode step of 128 rows
    was measured at 2 s (its thread paused with it in flight), then they took 12.4 ms. Twenty
    steps later the decode step predicted must be the steps' own, not the mean that the
    stall inflates: a decode worker's slack at 128 rows is about a millisecond a step."""
    clock = StepClock()
    context = 128 * 1460
    clock.record(tokens=128, rows=128, seconds=0.09, pairs=context)
    clock.record(tokens=128, rows=128, seconds=2.0, pairs=context)
    for i in range(20):
        clock.record(tokens=128, rows=128, seconds=0.0124, pairs=context + 128 * i)
    assert clock.decode.predict(128, context + 2560) > 0.05  # the mean, stall and all
    assert clock.decode_step(128, context + 2560) == pytest.approx(0.0124, rel=0.05)
    # moved along the fit to other rows: fewer rows, a shorter step
    assert clock.decode_step(64, context / 2) < clock.decode_step(128, context)


def load(prefill: tuple[float, float, float], decode: tuple[float, float, float], **kw) -> pb.Load:  # type: ignore[no-untyped-def]
    steps = pb.StepTimes(
        prefill_steps=prefill[0],
        prefill_tokens=prefill[1],
        prefill_seconds=prefill[2],
        decode_steps=decode[0],
        decode_rows=decode[1],
        decode_seconds=decode[2],
    )
    return pb.Load(step_times=steps, **kw)


def test_the_router_fits_each_worker_from_the_differences_between_its_reports() -> None:
    meter = ClusterMeter()
    meter.observe("w", load((0, 0, 0), (0, 0, 0)))
    assert meter.lines("w") == (None, None)
    # 10 steps of 1,000 tokens at 55 ms; then 10 of 2,000 at 105 ms: 5 ms + 0.05 ms/token
    meter.observe("w", load((10, 10_000, 0.55), (100, 800, 1.6)))
    meter.observe("w", load((20, 30_000, 1.6), (200, 2400, 3.6)))
    prefill, decode = meter.lines("w")
    assert prefill is not None and decode is not None
    assert prefill.intercept == pytest.approx(0.005) and prefill.slope == pytest.approx(5e-5)
    # decode: 100 steps of 8 rows at 16 ms, then of 16 rows at 20 ms: 12 ms + 0.5 ms/row
    assert decode.at(8) == pytest.approx(0.016) and decode.at(16) == pytest.approx(0.020)
    # a restarted worker reports from zero: a new baseline, not a negative sample
    meter.observe("w", load((1, 100, 0.01), (0, 0, 0)))
    assert meter.lines("w") == (None, None)


def test_the_router_fits_the_attention_term_from_the_pairs_workers_report() -> None:
    meter = ClusterMeter()
    meter.observe("w", load((0, 0, 0), (0, 0, 0)))
    steps, tokens, seconds, pairs = 0.0, 0.0, 0.0, 0.0
    # between heartbeats, 10 chunks of one size at one context: short and long chunks of
    # the first and of a late part of a prompt
    for chunk, context in ((512, 0), (2048, 0), (512, 8192), (2048, 8192)):
        steps, tokens = steps + 10, tokens + 10 * chunk
        seconds += 10 * PREFILL.chunk(chunk, context)
        pairs += 10 * chunk_pairs(chunk, context)
        report = load((steps, tokens, seconds), (0, 0, 0))
        report.step_times.prefill_pairs = pairs
        meter.observe("w", report)
    prefill, _ = meter.lines("w")
    assert prefill is not None
    assert prefill.attention == pytest.approx(PREFILL.attention, rel=1e-6)
    assert prefill.chunk(2048, 10_000) == pytest.approx(PREFILL.chunk(2048, 10_000))


def test_the_transfer_rate_is_bytes_sent_over_seconds_sending() -> None:
    meter = ClusterMeter()
    assert meter.transfer_rate is None
    meter.observe("p", load((0, 0, 0), (0, 0, 0), kv_bytes_sent=0, kv_send_seconds=0))
    meter.observe("p", load((0, 0, 0), (0, 0, 0), kv_bytes_sent=4e9, kv_send_seconds=0.5))
    assert meter.transfer_rate == pytest.approx(8e9)


def test_the_router_predicts_a_workers_prompt_steps_by_the_workers_own_fit() -> None:
    """A decode worker sizes the chunks it computes itself by its own fit of its prompt
    steps, step by step, and reports that line: the router predicts those chunks by the
    same line rather than by one fitted through the means of each second's steps (which
    keep less of the spread that tells a token's cost from a step's). A worker that
    reports none is fitted as before."""
    clock, meter, older = StepClock(), ClusterMeter(), ClusterMeter()
    rng = random.Random(7)

    def report(own_line: bool = True) -> pb.Load:
        load = pb.Load(step_times=to_proto(clock.report(), pb.StepTimes()))
        if not own_line:  # an older worker's report
            load.step_times.prefill_slope = 0.0
        return load

    for _ in range(30):  # seconds, 20 steps each: chunks beside 128 decode rows
        for _ in range(20):
            chunk, rows = rng.choice((100, 400, 1500, 3000)), 128
            seconds = (0.012 + PREFILL.marginal.chunk(chunk, 0)) * rng.uniform(0.9, 1.1)
            clock.record(chunk + rows, rows, seconds, chunk_pairs(chunk, 0))
        meter.observe("d", report())
        older.observe("d", report(own_line=False))
    own, _ = meter.lines("d")
    assert own == clock.prefill.line()
    assert own.marginal.chunk(1331, 0) == pytest.approx(PREFILL.marginal.chunk(1331, 0), rel=0.15)
    fitted, _ = older.lines("d")
    assert fitted is not None and fitted != own
