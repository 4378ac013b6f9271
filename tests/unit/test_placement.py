"""Placement: the threshold rule, the cost model on fixed measurements, and the fits the
router makes from workers' load reports."""

from __future__ import annotations

import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.common.step_times import LinearFit, StepClock
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
    local_estimate,
    threshold_says_local,
)

# An 8B-like worker: a prompt step costs 5 ms + 0.05 ms a token (20k tokens/s), a decode
# step 8 ms + 0.04 ms a row; KV of 128 KiB a token over a 10 GB/s link.
PREFILL = Line(0.005, 0.00005)
DECODE = Line(0.008, 0.00004)
KV_BYTES = 128 * 1024
SLO = Slo(ttft=2.0, tpot=0.02)


def cluster(d_cached: int, p_cached: int = 0, d_running: int = 8, d2_cached: int = 0) -> Cluster:
    return Cluster(
        prefills=(WorkerState("p", p_cached, 0, 0, PREFILL, None),),
        decodes=(
            WorkerState("d1", d_cached, d_running, 0, PREFILL, DECODE),
            WorkerState("d2", d2_cached, d_running, 0, PREFILL, DECODE),
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


def test_cost_sends_a_long_new_prompt_to_the_prefill_worker() -> None:
    chosen = choose_by_cost(8000, cluster(d_cached=0), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.prefill) == (FULL, "p")


def test_cost_sends_only_the_missing_pages_to_the_decode_worker_that_holds_a_prefix() -> None:
    # a long new question after a short shared system prompt: P computes it, and the D
    # that holds the system prompt receives only the rest
    chosen = choose_by_cost(8000, cluster(d_cached=0, p_cached=2000, d2_cached=2000), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.decode, chosen.prefill) == (DELTA, "d2", "p")


def test_a_decode_worker_whose_steps_fill_the_tpot_slo_prefills_nothing() -> None:
    slow = WorkerState("d", 3800, running=300, queued=0, prefill=PREFILL, decode=DECODE)
    # a step of 300 tokens takes 5 ms + 15 ms: the 300 running rows leave no room
    assert local_estimate(4000, slow, SLO) is None
    busy = cluster(d_cached=3800, d_running=300)
    chosen = choose_by_cost(4000, busy, SLO)
    assert chosen is not None and chosen.kind != LOCAL


def test_local_prefill_is_predicted_in_steps_that_keep_the_tpot_slo() -> None:
    d = WorkerState("d", 0, running=10, queued=0, prefill=PREFILL, decode=DECODE)
    # 20 ms fits 300 tokens a step, 290 of them the prompt's: 1,000 tokens take 4 steps
    estimate = local_estimate(1000, d, SLO)
    assert estimate is not None
    assert estimate.ttft == pytest.approx(4 * PREFILL.at(290 + 10))
    assert estimate.delay_to_others > 0  # the running requests' steps got longer


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
    intercept, slope = fit.coefficients()
    assert intercept == pytest.approx(0.004) and slope == pytest.approx(0.00006)
    assert fit.largest_within(0.064) == pytest.approx(1000)
    one_size = LinearFit()
    one_size.add(100, 0.01)
    assert one_size.coefficients() == (0.0, pytest.approx(0.0001))  # proportional


def test_the_step_clock_tells_prompt_steps_from_decode_steps() -> None:
    clock = StepClock()
    clock.record(tokens=300, rows=3, seconds=0.02)  # a chunk with two decode rows along
    clock.record(tokens=8, rows=8, seconds=0.01)  # decode rows only
    t = clock.times
    assert (t.prefill_steps, t.prefill_tokens, t.decode_steps, t.decode_rows) == (1, 300, 1, 8)


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


def test_the_transfer_rate_is_bytes_sent_over_seconds_sending() -> None:
    meter = ClusterMeter()
    assert meter.transfer_rate is None
    meter.observe("p", load((0, 0, 0), (0, 0, 0), kv_bytes_sent=0, kv_send_seconds=0))
    meter.observe("p", load((0, 0, 0), (0, 0, 0), kv_bytes_sent=4e9, kv_send_seconds=0.5))
    assert meter.transfer_rate == pytest.approx(8e9)
