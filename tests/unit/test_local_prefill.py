"""A decode worker computing prompts itself (the router's `local` placement), beside the
PD kinds, in one process: one P and two D's joined by the real KV transfer layer."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from baton.common.disagg import decode_role
from baton.common.disagg.decode_role import DecodeRole
from baton.common.disagg.slack import PROBE_TOKENS, LatePrompts, SlackPlan
from baton.common.engine.piecewise_graph import PiecewiseGraphRunner
from baton.common.engine.step_clock import StepBudget, StepClock
from baton.common.protocol import GenerateReq, PeerInfo
from baton.common.sampling import SamplingParams
from baton.common.step_times import Line, LinearFit, chunk_pairs
from tests.conftest import hf_greedy, random_prompts
from tests.unit.test_disagg_inprocess import assert_drained, make_side, shutdown

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


def step_all(*sides) -> None:  # type: ignore[no-untyped-def]
    for sched, handler, _ in sides:
        handler.poll()
        if sched.has_work():
            sched.step()
        handler.poll()


def run(sides, sent: dict[str, tuple], timeout: float = 60.0) -> dict[str, list[int]]:  # type: ignore[no-untyped-def,type-arg]
    """Step every side until each request in `sent` (rid -> (d_sink, p_sink or None)) is
    done; its tokens, P's first then D's."""
    deadline = time.monotonic() + timeout
    while any(rid not in d_sink.done for rid, (d_sink, _) in sent.items()) or any(
        h.has_work() for _, h, _ in sides
    ):
        assert time.monotonic() < deadline, "the requests did not finish"
        step_all(*sides)
    outs = {}
    for rid, (d_sink, p_sink) in sent.items():
        first = p_sink.tokens.pop(rid) if p_sink is not None else []
        outs[rid] = first + d_sink.tokens.pop(rid)
        assert d_sink.done.pop(rid).error == ""
    return outs


def local(d, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:  # type: ignore[no-untyped-def]
    d[1].on_generate(GenerateReq(rid, prompt, params))


def start_long_answers(d, seed: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Two local requests of 300 tokens decoding on `d`; their prompts."""
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    short = random_prompts([5, 6], vocab=2000, seed=seed)
    for i, prompt in enumerate(short):
        local(d, f"running{i}", prompt, params)
    for _ in range(3):
        step_all(d)
    assert len(d[0].decode.running) == 2
    return short


def disagg(p, d, rid: str, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    room = random.getrandbits(62) | 1
    (_, ph, _), (_, dh, _) = p, d
    dh.on_generate(GenerateReq(rid, prompt, GREEDY, room, PeerInfo("p", ph.kv_control_address)))
    d_peer = PeerInfo("d", dh.kv_control_address, dh.transfer_address)
    ph.on_generate(GenerateReq(rid, prompt, GREEDY, room, d_peer))


def test_every_placement_kind_matches_transformers_in_1p2d(tiny_model) -> None:
    """Turn one of a chat goes to D1 through P (full: D1 holds nothing); turn two, which
    starts with turn one and its answer, goes to D1 again with only the missing pages
    (delta), and to D1 computing it itself (local); D2, which holds nothing, computes it
    itself too. Every answer is transformers' greedy answer."""
    p = make_side(tiny_model, "prefill", "tcp", page_size=4, chunked_prefill_size=32)
    d1 = make_side(tiny_model, "decode", "tcp", page_size=4)
    d2 = make_side(tiny_model, "decode", "tcp", page_size=4)
    sides = (p, d1, d2)
    try:
        turn1 = random_prompts([90], vocab=2000, seed=3)[0]
        disagg(p, d1, "full", turn1)
        out1 = run(sides, {"full": (d1[2], p[2])})
        assert out1["full"] == hf_greedy(tiny_model, turn1, MAX_NEW)
        turn2 = turn1 + out1["full"] + random_prompts([20], vocab=2000, seed=4)[0]
        want = hf_greedy(tiny_model, turn2, MAX_NEW)

        sent_before = p[1].stats()["kv_pages_sent"]
        assert sent_before == -(-len(turn1) // 4)  # full: every page of turn one
        disagg(p, d1, "delta", turn2)
        outs = run(sides, {"delta": (d1[2], p[2])})
        assert outs["delta"] == want
        # delta: D1 held turn one and its answer (24 whole pages), the other 7 travelled
        assert p[1].stats()["kv_pages_sent"] - sent_before == -(-len(turn2) // 4) - 24
        local(d1, "local-cached", turn2)
        local(d2, "local-cold", turn2)
        outs = run(sides, {"local-cached": (d1[2], None), "local-cold": (d2[2], None)})
        assert outs == {"local-cached": want, "local-cold": want}
        assert d1[1].stats()["local_prefills"] == 1
        assert d1[0].prefill.hit_tokens >= 96  # local: turn one and its answer, whole pages
        assert d2[0].prefill.hit_tokens == 0
        assert_drained(*sides)
    finally:
        shutdown(*sides)


@pytest.mark.parametrize("pieces", [False, True])
def test_local_prefill_beside_running_requests_keeps_to_the_step_budget(
    tiny_model, monkeypatch: pytest.MonkeyPatch, pieces: bool
) -> None:
    """Three requests decode on D while a 300-token prompt arrives for D to compute: every
    step's chunk costs at most what the slack rule allows on top of the decode step, the
    running requests decode in those same steps, and every answer is transformers'. With
    piecewise graphs, a chunk grows into the padding of its step's captured size (those
    rows are computed either way)."""
    d = make_side(tiny_model, "decode", "tcp", page_size=4, chunked_prefill_size=512)
    sched, role, sink = d
    sizes = []
    if pieces:  # CPU pieces: the same buffers and order as a GPU's graphs
        runner = sched.runner
        runner.piecewise_graphs = PiecewiseGraphRunner(
            runner.model, runner.attn, 0, 256, torch.device("cpu"), None
        )
        runner.piecewise_graphs.capture()
        sizes = runner.piecewise_sizes
    steps: list[tuple[float | None, list[tuple[int, int]], int]] = []  # (seconds, chunks, rows)
    budget_of = role.prefill_budget

    def budget(running, clock: StepClock) -> StepBudget | None:  # type: ignore[no-untyped-def]
        b = budget_of(running, clock)
        steps.append((b.seconds if b is not None else None, [], 0))
        return b

    launch = sched._launch

    def launched(batch):  # type: ignore[no-untyped-def]
        chunks = [
            (it.extend_len, it.prefix_len)
            for it in batch.items
            if it.extend_len > 1 or not it.sample
        ]
        rows = sum(1 for it in batch.items if it.extend_len == 1 and it.sample)
        steps[-1] = (steps[-1][0], chunks, rows)
        return launch(batch)

    role.prefill_budget, sched._launch = budget, launched  # type: ignore[method-assign]
    try:
        short = random_prompts([5, 6, 7], vocab=2000, seed=8)
        long = random_prompts([300], vocab=2000, seed=9)[0]
        params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
        for i, prompt in enumerate(short):
            local(d, f"short{i}", prompt, params)
        for _ in range(4):
            step_all(d)
        assert len(sched.decode.running) == 3
        # measured lines so heavy that the CPU's own steps hardly move them: a prompt step
        # of 1 ms + 0.1 ms a token, a decode step of 1 ms; an SLO of 500 ms, whose slack
        # (59 tokens to 450 ms) is tens of seconds even when a loaded CPU's real steps take
        # 40 ms (slack is counted from the requests' real times; at an SLO of 50 ms it ran
        # out on a busy machine), and a stall ceiling of a twentieth of it: 24 ms, 240
        # tokens on top of the decode step
        monkeypatch.setattr(decode_role, "MAX_STALL_SLOS", 0.05)
        line = LinearFit(decay=1.0)
        for tokens, pairs in ((10, 0), (50, 0), (100, 0), (100, 1e5)):  # (pairs cost nothing:
            line.add(tokens, 0.001 + 0.0001 * tokens, weight=1e9, pairs=pairs)  # not left
        sched.clock.prefill = line  # to the real steps, whose times a busy CPU stretches)
        # (a decode step is predicted from the last real ones: pinned, as the line is)
        monkeypatch.setattr(sched.clock, "decode_step", lambda rows, pairs: 0.001)
        role.tpot_slo = 0.5
        steps.clear()
        local(d, "long", long)
        want = {f"short{i}": hf_greedy(tiny_model, p, 60) for i, p in enumerate(short)}
        want["long"] = hf_greedy(tiny_model, long, MAX_NEW)
        outs = run((d,), {rid: (sink, None) for rid in want})
        assert outs == want
        prompt_steps = [(b, chunks, rows) for b, chunks, rows in steps if chunks]
        assert sum(n for _, chunks, _ in prompt_steps for n, _ in chunks) == 300
        marginal = line.line().marginal
        grew = 0
        for b, chunks, rows in prompt_steps:
            if not rows:
                continue
            # requests were decoding: the budget held, and they decoded alongside
            assert b is not None and b == pytest.approx(0.024, abs=1e-6)
            if not sizes or sum(chunks[-1]) == 300:  # (the prompt's last chunk: no growth)
                assert sum(marginal.chunk(n, prefix) for n, prefix in chunks) <= b + 1e-9
                continue
            ((n, prefix),) = chunks
            assert rows + n in sizes, (rows, n, sizes)
            # grown only into the padding: what the budget granted reached past the size
            # below, and that much fits
            below = max([s for s in sizes if s < rows + n], default=rows)
            assert marginal.chunk(below - rows + 1, prefix) <= b + 1e-9
            grew += marginal.chunk(n, prefix) > b
        assert grew or not sizes, "no chunk grew into its step's padding"
        assert sum(1 for _, _, rows in prompt_steps if rows == 3) >= 2
        assert sched.clock.times.decode_slack > 1.0
        assert_drained(d)
    finally:
        shutdown(d)


def fake_running(  # type: ignore[no-untyped-def]
    produced: int, elapsed: float, max_new: int = 343, context: int = 12_000, can_stop=True
):
    """A running request as the budget reads it: its first token `elapsed` seconds ago."""
    return SimpleNamespace(
        times={"first_token": time.monotonic() - elapsed},
        output_ids=[0] * produced,
        in_flight=0,
        sampling=SimpleNamespace(max_new_tokens=max_new, min_new_tokens=0, output_offset=0),
        device_len=context + produced,
        can_stop=can_stop,
    )


def test_the_budget_of_a_decode_worker_follows_the_slack_rule() -> None:
    """At 20 ms TPOT planned to 90% (18 ms), a decode step of 8 ms: a request that just
    began has 342 x 18 - 342 x 8 ms = 3.4 s of slack, so the step may take the ceiling
    (10 SLOs: 0.2 s, 192 ms of it the chunk's); one whose stalls left it 50 ms may take
    50 ms; one past its SLO lets nothing be computed beside it."""
    clock = StepClock()
    role = SimpleNamespace(tpot_slo=0.02, transferring={}, late=LatePrompts())

    def budget(*running) -> StepBudget | None:  # type: ignore[no-untyped-def]
        return DecodeRole.prefill_budget(role, list(running), clock)  # type: ignore[arg-type]

    assert budget() is None  # nobody decodes: the engine's own budget
    fresh = fake_running(produced=1, elapsed=0.0)
    probe = budget(fresh)
    assert probe is not None and probe.tokens == PROBE_TOKENS  # no prompt step measured yet
    clock.decode.add(4, 0.008)
    clock.decode.add(8, 0.008)
    for context, tokens in ((0, 512), (0, 2048), (8192, 512), (8192, 2048)):
        pairs = chunk_pairs(tokens, context)
        clock.prefill.add(tokens, 0.005 + 5e-5 * tokens + 1.3e-9 * pairs, pairs=pairs)
    b = budget(fresh)
    assert b is not None and b.seconds == pytest.approx(0.192)
    assert clock.times.decode_slack == pytest.approx(342 * 0.018 - 342 * 0.008, abs=1e-3)
    # its chunk: tokens and attention on top of the decode step, sized for its context
    early = b.take(20_000, context=0)
    late = budget(fresh).take(20_000, context=10_000)  # type: ignore[union-attr]
    assert 0.19 < clock.prefill.line().marginal.chunk(early, 0) <= 0.192
    assert late < early - 500
    # 200 tokens out, and stalls that left it 50 ms: its mean TPOT would end at 18 ms
    elapsed = 342 * 0.018 - 143 * 0.008 - 0.05
    tight = fake_running(produced=200, elapsed=elapsed)
    b = budget(fresh, tight)
    assert b is not None and b.seconds == pytest.approx(0.05, abs=1e-3)
    past = fake_running(produced=200, elapsed=elapsed + 0.1)
    b = budget(fresh, tight, past)
    assert b is not None and b.empty and b.take(100, 0) == 0
    assert clock.times.decode_slack == 0


def test_the_slack_of_long_contexts_counts_their_kv_reads() -> None:
    """The GPU's Mooncake run at x14: 12 requests of ~12k-token contexts decode at ~15 ms a
    step, where 8 rows of 1k contexts took 7 ms. Steps fitted at their contexts give the
    slack the long contexts leave (342 x (18 - 15.2) ms, under 1 s), not that of a line in
    rows (3.8 s)."""
    clock = StepClock()
    role = SimpleNamespace(tpot_slo=0.02, transferring={}, late=LatePrompts())

    def step(rows: int, context: int) -> float:  # 6 ms + 0.05 ms a row + 60 ns a KV token
        return 0.006 + 5e-5 * rows + 6e-8 * rows * (context + 1)

    for rows, context in ((8, 1000), (4, 1000), (8, 6000), (12, 12_000)):
        for _ in range(3):
            clock.record(rows, rows, step(rows, context), pairs=rows * (context + 1))
    running = [fake_running(produced=1, elapsed=0.0, context=12_000) for _ in range(12)]
    DecodeRole.prefill_budget(role, running, clock)  # type: ignore[arg-type]
    want = 342 * (0.018 - step(12, 12_000))
    assert clock.times.decode_slack == pytest.approx(want, abs=0.01) and want < 1.0
    assert clock.times.slack_tokens == 342  # each of its tokens to come takes that step
    assert clock.times.decode_pairs == pytest.approx(
        3 * sum(r * (c + 1) for r, c in ((8, 1000), (4, 1000), (8, 6000), (12, 12_000)))
    )


def test_a_started_local_prompt_past_its_ttft_slo_goes_on_without_slack() -> None:
    """No running request has slack left: a prompt not started waits (or is handed back),
    and so does a started one until its TTFT SLO (4 x start_within) passed; from then on it
    gets PROBE_TOKENS a step, where it had waited 36 s for the least-slack request to end
    (Mooncake x8, 2x H200). Once its whole prompt is computed the floor is gone."""
    clock = StepClock()
    clock.decode.add(4, 0.008)
    clock.decode.add(8, 0.008)
    for tokens in (512, 2048):
        clock.prefill.add(tokens, 0.005 + 5e-5 * tokens, pairs=chunk_pairs(tokens, 0))
    role = SimpleNamespace(tpot_slo=0.02, transferring={}, late=LatePrompts())
    past = fake_running(produced=200, elapsed=342 * 0.018)  # no slack left
    prompt = SimpleNamespace(rid="local", device_len=3000, finished=False)

    def budget() -> StepBudget:
        b = DecodeRole.prefill_budget(role, [past], clock)  # type: ignore[arg-type]
        assert b is not None
        return b

    assert budget().empty
    role.late.placed("local", time.monotonic() - 0.5, start_within=0.1)  # due 0.1 s ago
    assert budget().empty  # placed, not started: the hand-back's, not the floor's
    role.late.computed(prompt, last=False)  # its first chunk
    assert budget().take(10_000, 3000) == PROBE_TOKENS
    role.late.computed(prompt, last=True)
    assert budget().empty
    role.late.placed("on-time", time.monotonic(), start_within=0.5)  # due in 2 s
    role.late.computed(SimpleNamespace(rid="on-time", device_len=100, finished=False), False)
    assert budget().empty


def test_requests_whose_kv_is_on_its_way_take_their_share_of_the_slack() -> None:
    """Two 12k-token requests in transfer join within a transfer and decode beside the 12
    running ones to their end: the slack is what the step of all 14 leaves, not the step
    of 12 (whose extra slack those two would pay for once they join)."""
    clock = StepClock()

    def step(rows: int, context: int) -> float:  # 6 ms + 0.05 ms a row + 60 ns a KV token
        return 0.006 + 5e-5 * rows + 6e-8 * rows * (context + 1)

    for rows, context in ((8, 1000), (4, 1000), (8, 6000), (12, 12_000), (16, 12_000)):
        for _ in range(3):
            clock.record(rows, rows, step(rows, context), pairs=rows * (context + 1))
    running = [fake_running(produced=1, elapsed=0.0, context=12_000) for _ in range(12)]
    coming = {
        f"r{i}": SimpleNamespace(req=SimpleNamespace(input_ids=[0] * 12_000)) for i in range(2)
    }
    alone = SimpleNamespace(tpot_slo=0.02, transferring={}, late=LatePrompts())
    DecodeRole.prefill_budget(alone, running, clock)  # type: ignore[arg-type]
    without = clock.times.decode_slack
    joined = SimpleNamespace(tpot_slo=0.02, transferring=coming, late=LatePrompts())
    DecodeRole.prefill_budget(joined, running, clock)  # type: ignore[arg-type]
    assert without == pytest.approx(342 * (0.018 - step(12, 12_000)), abs=0.01)
    assert clock.times.decode_slack == pytest.approx(342 * (0.018 - step(14, 12_000)), abs=0.02)
    assert clock.times.decode_slack < without - 0.04


def test_slack_is_planned_to_the_answers_the_worker_sees_not_to_max_tokens() -> None:
    """A chat client asks for up to 4,096 tokens; this worker's answers stop at 300-440. A
    request 100 tokens in at 12 ms a step, which an earlier stall already held 4 s: planned
    to 4,096 tokens it seems to have 20 s of slack, and D would stall it further, though
    it will likely end near 343 tokens, far past its SLO; planned to the lower quartile of
    the answers seen (320 tokens), it has none left, and D computes no prompt beside it."""
    clock = StepClock()
    role = SimpleNamespace(tpot_slo=0.02, transferring={}, late=LatePrompts())
    for _ in range(20):
        clock.record(1, 1, 0.012, pairs=1100)
    chatty = fake_running(produced=100, elapsed=99 * 0.012 + 4.0, max_new=4096, context=1000)
    b = DecodeRole.prefill_budget(role, [chatty], clock)  # type: ignore[arg-type]
    # no answer seen yet: planned to max_new_tokens
    assert clock.times.decode_slack == pytest.approx(
        0.018 * 4095 - (99 * 0.012 + 4.0) - 3996 * 0.012, abs=0.01
    )
    assert clock.times.slack_tokens == 3996 and b is not None and b.tokens > 0
    for tokens in (300, 320, 340, 360, 380, 400, 420, 440):
        clock.answers.add(tokens)
    b = DecodeRole.prefill_budget(role, [chatty], clock)  # type: ignore[arg-type]
    assert 0.018 * 319 - (99 * 0.012 + 4.0) - 220 * 0.012 < 0
    assert clock.times.decode_slack == 0 and clock.times.slack_tokens == 220
    assert b is not None and b.tokens == 0
    # what the worker's metrics show of it (`queue_stats`)
    assert role.plan == SlackPlan(pytest.approx(0.012), 0.0, 320)
    # never planned to fewer tokens than it has made and the next one
    long_one = fake_running(produced=500, elapsed=499 * 0.012, max_new=4096, context=1000)
    DecodeRole.prefill_budget(role, [long_one], clock)  # type: ignore[arg-type]
    assert clock.times.slack_tokens == 1
    # one that cannot stop early (ignore_eos, no grammar) is planned to its max_new_tokens
    sure = fake_running(100, 99 * 0.012 + 4.0, max_new=4096, context=1000, can_stop=False)
    DecodeRole.prefill_budget(role, [sure], clock)  # type: ignore[arg-type]
    assert clock.times.slack_tokens == 3996 and clock.times.decode_slack > 20
    # nor before min_new_tokens
    assert clock.answers.planned_total(4096, 10, min_new=1000) == 1000
    # resumed here 200 tokens into its answer (a recompute migration): planned to the
    # same 320 tokens in all, 20 made here so far, 100 to come
    resumed = fake_running(produced=20, elapsed=19 * 0.012, max_new=3896, context=1000)
    resumed.sampling.output_offset = 200
    DecodeRole.prefill_budget(role, [resumed], clock)  # type: ignore[arg-type]
    assert clock.times.slack_tokens == 100


def test_the_scheduler_counts_the_answers_that_ended(tiny_model) -> None:
    """Answers that could have stopped early count, at the length they ended (stopped or
    ran to their max_new_tokens); one that could not (no stop token) tells nothing of how
    long answers run, nor does an aborted one."""
    d = make_side(tiny_model, "decode", "tcp", page_size=4)
    sched, role, sink = d
    try:
        prompts = random_prompts([5, 6, 7], vocab=2000, seed=3)
        for i, prompt in enumerate(prompts):  # (a stop token the greedy answers never give)
            params = SamplingParams(
                temperature=0.0, max_new_tokens=4 + i, ignore_eos=True, stop_token_ids=[1999]
            )
            local(d, f"r{i}", prompt, params)
        local(d, "sure", prompts[1])  # ignore_eos alone: runs to its max_new_tokens
        local(d, "gone", prompts[0])
        step_all(d)
        role.on_abort("gone")
        run((d,), {rid: (sink, None) for rid in ("r0", "r1", "r2", "sure")})
        assert sorted(sched.clock.answers.lengths) == [4, 5, 6]
        stats = role.stats()  # (its metrics: baton_worker_role_{seconds,items})
        assert stats["planned_answer_tokens"] == 0  # three answers: too few to plan with
        assert stats["planned_decode_step_seconds"] >= 0 and stats["least_slack_seconds"] >= 0
    finally:
        shutdown(d)


def test_an_abort_mid_local_prefill_leaks_no_page(tiny_model) -> None:
    d = make_side(tiny_model, "decode", "tcp", page_size=4, chunked_prefill_size=16)
    sched, role, sink = d
    try:
        prompt = random_prompts([200], vocab=2000, seed=11)[0]
        local(d, "long", prompt)
        for _ in range(3):
            step_all(d)
        req = sched.requests["long"]
        assert 0 < req.device_len < len(prompt), "the prompt is being computed in chunks"
        role.on_abort("long")
        for _ in range(3):
            step_all(d)
        assert sink.done["long"].finish_reason.value == "abort"
        assert sink.tokens.get("long", []) == []
        assert_drained(d)
    finally:
        shutdown(d)


def test_a_local_prompt_waiting_for_slack_does_not_hold_back_rooms(tiny_model) -> None:
    """D decodes requests whose TPOT slack is spent, so its local prompt waits for slack;
    a request P computes for it meanwhile is admitted (its room reserved) and answered
    without waiting for the local prompt (on 2x H200, P's requests waited behind such
    prompts: TTFT 1-2 s at 20 req/s, 0.2 s without local prompts). Once slack returns, the
    local prompt is computed; every answer is transformers'."""
    p = make_side(tiny_model, "prefill", "tcp", page_size=4)
    d = make_side(tiny_model, "decode", "tcp", page_size=4, chunked_prefill_size=64)
    sched, role, sink = d
    budget_of = role.prefill_budget
    spent = {"slack": False}

    def budget(running, clock: StepClock) -> StepBudget | None:  # type: ignore[no-untyped-def]
        return StepBudget(tokens=0) if spent["slack"] and running else budget_of(running, clock)

    role.prefill_budget = budget  # type: ignore[method-assign]
    try:
        short = start_long_answers(d, seed=21)
        spent["slack"] = True
        waiting, remote = random_prompts([120, 40], vocab=2000, seed=22)
        local(d, "waiting", waiting)
        disagg(p, d, "remote", remote)
        deadline = time.monotonic() + 60
        while "remote" not in sink.done:
            assert time.monotonic() < deadline
            step_all(p, d)
        # answered while the running requests still decode (and the local prompt waits)
        assert not [rid for rid in sink.done if rid.startswith("running")], (
            "the remote request waited for the local prompt"
        )
        assert sched.requests["waiting"].device_len == 0, "no slack: no prompt token computed"
        assert sink.done["remote"].error == ""
        remote_out = p[2].tokens.pop("remote") + sink.tokens.pop("remote")
        assert remote_out == hf_greedy(tiny_model, remote, MAX_NEW)
        sink.done.pop("remote")
        spent["slack"] = False
        want = {f"running{i}": hf_greedy(tiny_model, pr, 300) for i, pr in enumerate(short)}
        want["waiting"] = hf_greedy(tiny_model, waiting, MAX_NEW)
        assert run((p, d), {rid: (sink, None) for rid in want}) == want
        assert_drained(p, d)
    finally:
        shutdown(p, d)


def test_a_local_prompt_the_slack_rule_does_not_start_in_time_is_handed_back(tiny_model) -> None:
    """D's running requests have no TPOT slack: a local prompt placed there with
    `start_within` ends unstarted after it (finish reason `handed_back`, nothing computed,
    no page held) for the router to place again. One that starts in time is answered."""
    d = make_side(tiny_model, "decode", "tcp", page_size=4, chunked_prefill_size=64)
    sched, role, sink = d
    spent = {"slack": False}

    def budget(running, clock: StepClock) -> StepBudget | None:  # type: ignore[no-untyped-def]
        # no slack, or 64 prompt tokens a step (a CPU's steps have no TPOT to go by)
        return StepBudget(tokens=0 if spent["slack"] else 64) if running else None

    role.prefill_budget = budget  # type: ignore[method-assign]
    try:
        short = start_long_answers(d, seed=31)
        spent["slack"] = True
        late, in_time = random_prompts([120, 40], vocab=2000, seed=32)
        d[1].on_generate(GenerateReq("late", late, GREEDY, start_within=0.05))
        deadline = time.monotonic() + 30
        while "late" not in sink.done:
            assert time.monotonic() < deadline, "the prompt was neither started nor handed back"
            step_all(d)
        assert sink.done.pop("late").finish_reason.value == "handed_back"
        assert sink.tokens.pop("late", []) == []
        assert "late" not in sched.requests and len(sched.prefill) == 0
        assert role.queue_stats()["local_handed_back"] == 1
        assert len(role.late) == 0  # nothing kept of it to watch
        assert not [rid for rid in sink.done if rid.startswith("running")]
        spent["slack"] = False
        want = {f"running{i}": hf_greedy(tiny_model, pr, 300) for i, pr in enumerate(short)}
        want["in_time"] = hf_greedy(tiny_model, in_time, MAX_NEW)
        d[1].on_generate(GenerateReq("in_time", in_time, GREEDY, start_within=0.05))
        assert run((d,), {rid: (sink, None) for rid in want}) == want
        assert role.queue_stats()["local_handed_back"] == 1 and not role.late.start_by
        assert len(role.late) == 0
        assert_drained(d)
    finally:
        shutdown(d)


@pytest.mark.parametrize("radix", [True, False])
def test_a_decode_worker_without_a_prefix_cache_computes_the_whole_prompt(
    tiny_model, radix: bool
) -> None:
    d = make_side(tiny_model, "decode", "tcp", page_size=4, disable_radix_cache=not radix)
    try:
        prompt = random_prompts([50], vocab=2000, seed=12)[0]
        for rid in ("a", "b"):
            local(d, rid, prompt)
            assert run((d,), {rid: (d[2], None)})[rid] == hf_greedy(tiny_model, prompt, MAX_NEW)
        assert d[0].prefill.hit_tokens == (48 if radix else 0)
        assert_drained(d)
    finally:
        shutdown(d)


def test_a_step_budget_is_shared_by_the_chunks_of_one_step() -> None:
    """0.1 s of 0.05 ms a token and 1.3 ns a pair: a first chunk at context 0 takes what
    fits, a second prompt in the same step gets only the rest, and a late chunk of a long
    prompt (context 10k) gets fewer tokens than an early one."""
    marginal = Line(0.0, 5e-5, 1.3e-9)
    early = StepBudget(0.1, marginal).take(5000, 0)
    late = StepBudget(0.1, marginal).take(5000, 10_000)
    assert marginal.chunk(early, 0) <= 0.1 < marginal.chunk(early + 1, 0)
    assert late < early * 0.85
    shared = StepBudget(0.1, marginal)
    first = shared.take(1000, 0)
    second = shared.take(5000, 0)
    assert first == 1000 and 0 < second < early

    # (two prompts attend each to their own tokens: fewer pairs than one of both)
    def step(n: int) -> float:
        return marginal.at(first + n, chunk_pairs(first, 0) + chunk_pairs(n, 0))

    assert step(second) <= 0.1 < step(second + 1)
    assert shared.take(5000, 0) == 0 or shared.empty
    assert StepBudget(tokens=64).take(100, 0) == 64


def test_a_chunk_grows_into_its_steps_padding_within_what_it_may_take() -> None:
    """Steps replayed for 16/32/48/64 tokens beside 5 decode rows: a chunk the line grants
    20 tokens (25 rows: padded to 32) takes 27, never more than it asked for or the
    budget's token cap, and a step past the largest size is left as granted."""
    line = Line(0.0, 1e-3, 0.0)  # 1 ms a token

    def budget(seconds: float = 0.0205, tokens: float = float("inf")) -> StepBudget:
        return StepBudget(seconds, line, tokens, padded_sizes=(16, 32, 48, 64), rows=5)

    assert budget().take(100, 0) == 27
    assert budget().take(22, 0) == 22  # all it asked for
    assert budget(tokens=24).take(100, 0) == 24
    shared = budget(seconds=0.04)
    assert shared.take(8, 0) == 8  # all it asked for (13 rows)
    assert shared.take(100, 0) == 35  # 32 granted by the line: 45 rows, padded to 48
    assert budget(seconds=0.07).take(100, 0) == 70  # 75 rows: past the largest size
