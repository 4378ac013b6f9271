"""A step that fails fails no innocent request: only the request that causes the failure
ends with an error, every other one completes token-exact (the oracle: transformers)."""

from __future__ import annotations

import pytest

from baton.common.engine.engine import Engine
from baton.common.engine.recovery import FatalEngineError
from baton.common.engine.scheduler import Scheduler
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

POISON = 1999  # a prompt holding this token makes every step that computes it fail


def poison_forward(sched: Scheduler) -> list[int]:
    """Make the model runner fail every step whose inputs contain POISON; count calls."""
    runner = sched.runner
    original = runner.execute
    calls: list[int] = []

    def execute(inputs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if (inputs.input_ids == POISON).any():
            raise RuntimeError("injected: this request breaks the step")
        return original(inputs)

    runner.execute = execute  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("overlap", [True, False])
def test_only_the_failing_request_fails(tiny_model, overlap: bool) -> None:
    prompts = random_prompts([5, 40, 77, 120], vocab=1500, seed=3)
    bad = [*prompts[1][:20], POISON, 3, 4]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with Engine(
        tiny_model, page_size=4, max_total_tokens=4096, disable_overlap=not overlap
    ) as engine:
        sched = engine.scheduler
        poison_forward(sched)
        for i, p in enumerate([*prompts[:2], bad, *prompts[2:]]):
            sched.add_request(f"r{i}", p, params)
        done = {}
        sched.sink = lambda req, toks, lps, fin: done.__setitem__(req.rid, req) if fin else None  # type: ignore[method-assign]
        for _ in range(500):
            if len(done) == 5:
                break
            sched.step()
        assert done["r2"].error.startswith("internal error") and done["r2"].finish_reason == "error"
        good = [done[r] for r in ("r0", "r1", "r3", "r4")]
        assert [r.error for r in good] == [""] * 4
        assert [r.output_ids for r in good] == [hf_greedy(tiny_model, p, 12) for p in prompts]
        assert sched.step_stats().failed_steps >= 2
        sched.check_integrity()
        assert engine.all_pages_free(), "pages leaked after the failed steps"


def test_a_broken_engine_gives_up(tiny_model) -> None:
    """When every request fails alone, the engine raises FatalEngineError (the worker
    then fails what it holds and exits, so the router routes around it)."""
    with Engine(tiny_model, max_total_tokens=1024) as engine:
        sched = engine.scheduler

        def broken(inputs):  # type: ignore[no-untyped-def]
            raise RuntimeError("the device is gone")

        sched.runner.execute = broken  # type: ignore[method-assign]
        for i in range(4):
            sched.add_request(f"r{i}", [1, 2, 3, i], SamplingParams(max_new_tokens=4))
        with pytest.raises(FatalEngineError):
            for _ in range(50):
                sched.step()
