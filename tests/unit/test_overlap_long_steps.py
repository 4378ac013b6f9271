"""`overlap_max_step_tokens`: a step longer than that is processed before the next is
scheduled, so a request that comes while it runs joins the next step, not the one after."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("limit", [0, 32])
def test_a_request_that_comes_during_a_long_step_joins_the_next(
    tiny_model: Path, limit: int
) -> None:
    long_prompt, short_prompt = random_prompts([160, 8], vocab=2000, seed=3)
    with Engine(tiny_model, chunked_prefill_size=64, overlap_max_step_tokens=limit) as engine:
        sched = engine.scheduler
        processed: list[set[tuple[str, int]]] = []
        process = sched.outputs.process

        def spy(batch, step, result):  # type: ignore[no-untyped-def]
            processed.append({(it.req.rid, it.end) for it in batch.items})
            process(batch, step, result)

        sched.outputs.process = spy  # type: ignore[method-assign]
        sched.add_request("long", long_prompt, GREEDY)  # chunks of 64, 64 and 32 tokens
        # `short` comes while the loop waits for long's second chunk: taken after that
        while not any(("long", 128) in batch for batch in processed):
            sched.step()
        sched.add_request("short", short_prompt, GREEDY)
        sched.drain()
        [with_short] = [batch for batch in processed if ("short", 8) in batch]
        # overlapped, long's last chunk was launched before short came: short computes in
        # the step after it; past a long step, in the same one
        assert (("long", 160) in with_short) == (limit > 0)
        for rid, prompt in (("long", long_prompt), ("short", short_prompt)):
            assert engine._done[rid].output_ids == hf_greedy(tiny_model, prompt, 3)
        assert engine.all_pages_free()
