"""The cost model on the measurements of GPU session 23 (4x H200, 8B shape, the Mooncake
conversation trace with whole conversations; benchmarks/results/gpu_2026-11-28_s23/).

At x14, 2P2D `cost` put 58 prompts of ~4k uncached tokens on decode workers whose steps
were already near the TPOT SLO (always-disagg: D's TPOT p50 14.3 ms, p90 22 ms): their
decoders slowed (TPOT p50 17 ms) and their admissions came late. At x8, below capacity,
local prefill of mostly-cached follow-up turns was fine (D's TPOT p99 16.5 ms)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from baton.common.rpc import baton_pb2 as pb
from baton.services.router.measurements import ClusterMeter
from baton.services.router.placement import (
    DELTA,
    LOCAL,
    Cluster,
    Line,
    Slo,
    WorkerState,
    choose_by_cost,
    local_estimate,
)

SLO = Slo(ttft=2.0, tpot=0.02)
# P's prompt step: 10 ms + 25 us a token + 1 ns a pair (a 15,172-token prompt alone took
# 0.47 s, ~4k-token suffixes ~27k tokens/s at x8).
PREFILL = Line(0.01, 2.5e-5, 1e-9)
# D's decode step: 8 ms + 0.05 ms a row + 60 ns a token of context read: 10 rows of 10k
# contexts take 14.5 ms (x14's always-disagg TPOT p50 14.3 ms), 5 rows of 8k 10.7 ms
# (x8's D TPOT p50 ~10 ms).
DECODE = Line(0.008, 5e-5, 6e-8)
KV_BYTES = 128 * 1024  # 8B: 32 layers x 8 KV heads x 128 x K and V in bf16
RATE = 8e9


def slack(produced: int, tpot_so_far: float, step: float, total: int = 343) -> float:
    """D's slack rule (`slack.tpot_slack`) for a request `produced` tokens into a
    343-token answer at that mean TPOT so far, planned at `step` a token from here."""
    return 0.9 * SLO.tpot * (total - 1) - (produced - 1) * tpot_so_far - (total - produced) * step


def x14_decode(step: float = 0.0165, context: float = 10 * 10_000, **kw) -> WorkerState:  # type: ignore[no-untyped-def]
    """D at x14: 10 rows of ~10k-token contexts, its steps now 16.5 ms (P-placed requests'
    TPOT p50 17 ms); two transfers waiting to join; its least-slack request 200 tokens in
    at 17 ms, planned at its line's step."""
    planned = DECODE.at(10, context)
    fields = dict(
        cached=512,
        running=10,
        queued=2,
        prefill=PREFILL,
        decode=DECODE,
        slack=slack(200, 0.017, planned),
        slack_tokens=143,
        step=step,
        step_rows=10,
        context=context,
    )
    return WorkerState("d", **(fields | kw))  # type: ignore[arg-type]


def two_ways(d: WorkerState, p: WorkerState) -> Cluster:
    return Cluster((p,), (d,), frozenset({("p", "d")}), KV_BYTES, RATE)


# x14's median local placement: a 4,467-token prompt, 512 of it cached (on D and on P);
# P has four prompts queued (its prefill queue p90 was 2.1 s in that run).
PROMPT, CACHED = 4467, 512
BUSY_P = WorkerState("p", CACHED, 0, 4, PREFILL, None)


def test_near_its_tpot_slo_a_decode_worker_gets_no_prompt_of_its_own() -> None:
    chosen = choose_by_cost(PROMPT, two_ways(x14_decode(), BUSY_P), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.prefill) == (DELTA, "p")
    # what the model saw before: D's step from its line in rows alone (8.5 ms at 10
    # rows) and its reported slack taken whole: local, as on the GPU
    before = x14_decode(step=0.0, step_rows=0, context=0.0, slack_tokens=0)
    before_chosen = choose_by_cost(PROMPT, two_ways(before, BUSY_P), SLO)
    assert before_chosen is not None and before_chosen.kind == LOCAL


def test_the_decode_step_now_and_the_joining_prompt_take_from_the_reported_slack() -> None:
    d = x14_decode(queued=0)
    reported = x14_decode(queued=0, slack_tokens=0, step=0.0, step_rows=0)  # at its word
    now, then = local_estimate(PROMPT, d, SLO), local_estimate(PROMPT, reported, SLO)
    assert now is not None and then is not None
    # the same stall spends a larger share of less slack: 143 tokens x 2.3 ms less
    assert now.delay_to_others > 1.5 * then.delay_to_others
    assert now.ttft > then.ttft  # each of its steps is D's slower decode step, and a chunk


def test_a_decode_worker_whose_steps_reach_the_slo_computes_no_prompt() -> None:
    # x14's TPOT p90 on D was 22 ms: at an 18 ms step (90% of the SLO) whatever slack
    # D reported, local is out, even for a prompt almost wholly cached there
    d = x14_decode(step=0.018, slack=3.0, slack_tokens=0, queued=0)
    assert local_estimate(PROMPT, d, SLO) is None
    assert local_estimate(10_000, replace(d, cached=9_984), SLO) is None
    # and its line says the same of 10 rows of 20k-token contexts (20.5 ms)
    step = DECODE.at(10, 10 * 20_000)
    long = x14_decode(step=step, context=10 * 20_000, slack=3.0, slack_tokens=0, queued=0)
    assert local_estimate(PROMPT, long, SLO) is None


def test_admissions_waiting_on_a_local_chunk_count_against_it() -> None:
    quiet = local_estimate(PROMPT, x14_decode(queued=0), SLO)
    waited = local_estimate(PROMPT, x14_decode(queued=4), SLO)
    assert quiet is not None and waited is not None
    chunk = PREFILL.marginal.chunk(PROMPT - CACHED, CACHED)  # one step's chunk (0.11 s)
    row = DECODE.slope + DECODE.attention * PROMPT  # and each joins D's batch before it
    assert waited.delay_to_others - quiet.delay_to_others == pytest.approx(4 * (chunk + row))


def test_below_capacity_a_mostly_cached_follow_up_is_computed_on_its_decode_worker() -> None:
    """x8: D decodes 5 rows of ~8k contexts at 10.5 ms, its least slack 2.5 s; turn 2 of
    a conversation, 8,200 tokens, 7,680 of them (its turn 1 and answer) cached on D."""
    context = 5 * 8000
    d = WorkerState(
        "d",
        cached=7680,
        running=5,
        queued=1,
        prefill=PREFILL,
        decode=DECODE,
        slack=slack(100, 0.011, DECODE.at(5, context)),
        slack_tokens=243,
        step=0.0105,
        step_rows=5,
        context=context,
    )
    idle_p = WorkerState("p", 0, 0, 0, PREFILL, None)
    chosen = choose_by_cost(8200, two_ways(d, idle_p), SLO)
    assert chosen is not None
    assert (chosen.kind, chosen.decode) == (LOCAL, "d")
    local = local_estimate(8200, d, SLO)
    assert local is not None and local.ttft < 0.1  # one step of 520 tokens beside 5 rows


def test_the_router_measures_a_workers_decode_step_now_and_its_kv_term() -> None:
    meter = ClusterMeter()

    def report(steps: float, rows: float, seconds: float, pairs: float) -> pb.Load:
        times = pb.StepTimes(
            decode_steps=steps, decode_rows=rows, decode_seconds=seconds, decode_pairs=pairs
        )
        return pb.Load(step_times=times)

    meter.observe("d", report(0, 0, 0, 0))
    assert meter.decode_now("d") is None
    total = [0.0, 0.0, 0.0, 0.0]
    for rows, context in ((4, 2000), (8, 2000), (8, 10_000), (10, 10_000)):
        pairs = rows * context
        for i, add in enumerate((100, 100 * rows, 100 * DECODE.at(rows, pairs), 100 * pairs)):
            total[i] += add
        meter.observe("d", report(*total))
    _, line = meter.lines("d")
    assert line is not None and line.attention == pytest.approx(DECODE.attention, rel=1e-6)
    now = meter.decode_now("d")
    assert now is not None
    assert (now.rows, now.pairs) == (10, 100_000)
    assert now.seconds == pytest.approx(0.0145)


# Session 33 (2x H200, random 1,330-token prompts, 256 out, SLO TTFT 1 s, TPOT 15 ms;
# benchmarks/results/gpu_2026-11-29_s33/): a prompt step of 8 ms + 22.3 us a token (the
# lab's fit of a decode worker's own mixed steps), a decode step of 3.6 ms + 62.5 us a row
# at ~1,460 tokens of context (7.6 ms at 64 rows, 11.6 at 128). 1P1D at 26 req/s: D
# decodes ~47 rows at 7.1 ms, its least slack ~1.6 s (255 tokens x (13.5 - 7.1) ms).
SLO_33 = Slo(ttft=1.0, tpot=0.015)
PROMPT_33 = Line(0.008, 2.23e-5)
DECODE_33 = Line(0.0036, 6.25e-5)


def d_33(**kw) -> WorkerState:  # type: ignore[no-untyped-def]
    fields = dict(
        running=47,
        prefill=PROMPT_33,
        decode=DECODE_33,
        slack=1.6,
        slack_tokens=128,
        step=0.0071,
        step_rows=47,
    )
    return WorkerState("d", **(fields | kw))  # type: ignore[arg-type]


def pair_33(d: WorkerState, p_queued: int) -> Cluster:
    p = WorkerState("p", 0, 0, p_queued, PROMPT_33, None)
    return Cluster((p,), (d,), frozenset({("p", "d")}), KV_BYTES)  # (ipc: no rate measured)


def test_below_its_prefill_workers_capacity_cost_places_as_always_disagg() -> None:
    """P idle: a new prompt goes to P, whose TTFT (~38 ms) no local step beats once the
    decoders' stall counts (s33: placed on D anyway, cost's goodput was 0.92x 1P1D's at
    20 req/s, with P looking ~70 requests behind and D's chunks predicted ~6x fast)."""
    chosen = choose_by_cost(1331, pair_33(d_33(), p_queued=0), SLO_33)
    assert chosen is not None and chosen.kind == "disagg-full"


def test_past_its_prefill_workers_capacity_cost_spends_d_slack_then_queues_on_p() -> None:
    """P six prompts behind (32 req/s: 1P1D's TTFT p50 1.1 s): prompts go to D while its
    slack covers them (each owed on it until answered), then to P again."""
    kinds = []
    owed = 0
    for _ in range(30):
        chosen = choose_by_cost(1331, pair_33(d_33(owed_prompts=(owed,)), p_queued=6), SLO_33)
        assert chosen is not None
        kinds.append(chosen.kind)
        if chosen.kind == LOCAL:
            owed += chosen.computes
    assert kinds[0] == LOCAL and kinds[-1] == "disagg-full"
    assert 2 <= kinds.count(LOCAL) <= 20, kinds
