"""Every scheduler mode gives transformers' greedy tokens and leaks no page."""

from __future__ import annotations

import itertools

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)

MODES = list(
    itertools.product(
        [False, True],  # disable_radix_cache
        [None, 16, 64],  # chunked_prefill_size
        [False, True],  # disable_overlap
        [False, True],  # enable_mixed_chunk
        [1, 16],  # page_size
    )
)


def _workload() -> list[list[int]]:
    shared = random_prompts([45], vocab=2000, seed=11)[0]
    sharing = random_prompts([3, 30, 70], vocab=2000, seed=12, prefix=shared)
    distinct = random_prompts([1, 9, 100], vocab=2000, seed=13)
    return [*sharing, *distinct]


@pytest.mark.parametrize(("no_radix", "chunk", "no_overlap", "mixed", "page_size"), MODES)
def test_mode_matches_transformers(
    tiny_model, no_radix, chunk, no_overlap, mixed, page_size
) -> None:
    prompts = _workload()
    expected = [hf_greedy(tiny_model, p, MAX_NEW) for p in prompts]
    with Engine(
        tiny_model,
        page_size=page_size,
        max_total_tokens=2048,
        disable_radix_cache=no_radix,
        chunked_prefill_size=chunk,
        disable_overlap=no_overlap,
        enable_mixed_chunk=mixed,
    ) as engine:
        # twice: the second pass hits the prefix cache; staggered arrival mixes prefill/decode
        for _ in range(2):
            outs = engine.generate(prompts, GREEDY)
            assert [o.output_ids for o in outs] == expected
            engine.check_integrity()
        sched = engine.scheduler
        sched.add_request("late-0", prompts[0], GREEDY)
        sched.step()
        sched.step()
        sched.add_request("late-1", prompts[4], GREEDY)
        done: dict[str, list[int]] = {}
        while sched.has_work():
            sched.step()
            engine.check_integrity()
        for rid in ("late-0", "late-1"):
            done[rid] = engine._done.pop(rid).output_ids
        assert done == {"late-0": expected[0], "late-1": expected[4]}
        assert engine.all_pages_free()


@pytest.mark.parametrize("overlap", [True, False])
def test_small_pool_retracts_and_completes(tiny_model, overlap: bool) -> None:
    """A pool a few times one request: every request completes, correct, nothing leaked."""
    prompts = random_prompts([40, 50, 60, 45, 55, 35, 65, 42], vocab=2000, seed=21)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    with Engine(
        tiny_model,
        page_size=4,
        max_total_tokens=320,
        decode_reserve_tokens=8,
        disable_overlap=not overlap,
    ) as engine:
        outs = engine.generate(prompts, params)
        assert [o.output_ids for o in outs] == [hf_greedy(tiny_model, p, 40) for p in prompts]
        assert engine.stats().retracted > 0, "the workload should force retraction"
        engine.check_integrity()
        assert engine.all_pages_free()


def test_shared_prefix_hits(tiny_model) -> None:
    prefix = random_prompts([200], vocab=2000, seed=31)[0]
    prompts = random_prompts([8] * 32, vocab=2000, seed=32, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    with Engine(tiny_model, page_size=16, max_total_tokens=16384) as engine:
        engine.generate(prompts, params)
        before = engine.stats()
        hits0, total0 = before.prefix_hit_tokens, before.prompt_tokens
        engine.generate(prompts, params)
        after = engine.stats()
        hit_rate = (after.prefix_hit_tokens - hits0) / (after.prompt_tokens - total0)
        assert hit_rate >= 0.8, f"second pass hit rate {hit_rate:.2f}"


def test_lpm_policy_prefers_cached_prefix(tiny_model) -> None:
    prefix = random_prompts([64], vocab=2000, seed=41)[0]
    warm = random_prompts([4], vocab=2000, seed=42, prefix=prefix)
    cold = random_prompts([68], vocab=2000, seed=43)
    with Engine(
        tiny_model,
        page_size=16,
        schedule_policy="lpm",
        max_running_requests=1,
        max_prefill_tokens=80,
    ) as engine:
        engine.generate(warm, GREEDY)
        sched = engine.scheduler
        sched.add_request("cold", cold[0], GREEDY)
        sched.add_request("warm", random_prompts([5], 2000, 44, prefix=prefix)[0], GREEDY)
        sched.step()
        running = [r.rid for r in sched.decode.running]
        assert running == ["warm"]
        sched.drain()


def test_step_statistics(tiny_model) -> None:
    with Engine(tiny_model, page_size=4, max_total_tokens=1024) as engine:
        sched = engine.scheduler
        for i, p in enumerate(random_prompts([10, 20, 30], vocab=2000, seed=51)):
            sched.add_request(f"r{i}", p, GREEDY)
        s = engine.stats()
        assert (s.queued, s.running) == (3, 0)
        sched.step()
        s = engine.stats()
        assert s.running == 3 and s.queued == 0 and s.tokens_this_step == 60
        assert s.pages_free + s.pages_cached + s.pages_in_use == 256
        sched.drain()
        s = engine.stats()
        assert s.running == 0 and s.pages_in_use == 0


def test_overlap_launches_behind_a_step_in_flight_and_alone_at_once(tiny_model) -> None:
    """With overlap, a step queued behind one in flight is launched by the forward thread
    while the scheduler goes on; a step with nothing in flight (a lone prompt's, the first
    token's path) is launched by the scheduler itself, without waiting for that thread to
    wake up."""
    import threading

    with Engine(tiny_model, max_total_tokens=2048) as engine:
        runner = engine.scheduler.runner
        execute = runner.execute
        threads: list[str] = []

        def recorded(inputs):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return execute(inputs)

        runner.execute = recorded  # type: ignore[method-assign]
        prompt = random_prompts([20], vocab=2000, seed=3)[0]
        out = engine.generate([prompt], GREEDY)[0]
        assert out.output_ids == hf_greedy(tiny_model, prompt, MAX_NEW)
        me = threading.current_thread().name
        assert threads[0] == me  # the prompt: nothing in flight
        assert any(name != me for name in threads[1:])  # decode steps overlapped
