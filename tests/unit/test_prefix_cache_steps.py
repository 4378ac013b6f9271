"""A step never writes one KV slot or one table cell twice.

A request whose prompt the prefix cache holds whole still computes its last page (the
last token's logits are needed). The cache used to swap that page for the tree's copy
while the step was being scheduled, freeing the request's own, which the step was about
to write; the next request of the same step could be handed it. Two requests' KV then
went to the same slots, and the table got two values for the same cells. On a CPU the
last write wins and hid it; on a GPU which write lands is undefined, and cached prompts
came out as other tokens from one engine to the next (H200, 2026-11-27)."""

from __future__ import annotations

import pytest

from baton.common.cache.manager import check_step_writes
from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.unit.test_engine_components import parts, req


def test_cached_prompts_never_share_a_steps_slots(tiny_model) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts([3, 40, 120, 7, 9, 11, 13], vocab=200, seed=6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    with Engine(tiny_model, page_size=4) as fresh:
        expected = [o.output_ids for o in fresh.generate(prompts[:3], greedy)]
    # every step checks it writes no KV slot or table cell twice (BATON_CHECK_STEPS,
    # tests/conftest.py): a step that did would stop the engine
    with Engine(tiny_model, page_size=4) as engine:
        engine.generate(prompts, greedy)  # every prompt and its answer in the tree
        engine.generate(prompts[:1], SamplingParams(temperature=0.7, seed=1, max_new_tokens=24))
        # two equal answers: the second one's pages are the tree's copies when it ends,
        # and the rows it gives up must take no table write with them into the next step
        engine.generate([prompts[3]] * 2, greedy)
        got = engine.generate(prompts[:3], greedy)
        engine.check_integrity()
    assert all(o.cached_tokens > 0 for o in got[1:])
    assert [o.output_ids for o in got] == expected


def test_a_rows_later_staged_write_wins_and_a_given_up_row_takes_none() -> None:
    """A decode worker reserves a request's pages for its prompt's KV, then finds the
    tree holds those pages and takes the tree's: both writes to the row are staged
    before the step. The step gets the row's final contents once."""
    cache, _, _ = parts(16)
    a = req("a", list(range(8)))
    cache.admit(a)
    cache.extend(a, 8)
    cache.cache_prefix(a)  # two pages into the tree
    cache.release(a)
    cache.take_staged()
    b = req("b", list(range(8)))
    cache.admit(b)  # the tree's first page (the last token is always computed)
    cache.extend(b, 8 - b.device_len)  # its own second page, as a decode worker reserves
    cache.cache_prefix(b)  # the tree has the second page too: b takes it
    writes = cache.take_staged()
    assert [(row, start, list(values)) for row, start, values in writes] == [
        (b.slot, 0, [p * 4 + i for p in b.pages for i in range(4)])
    ]
    check_step_writes([], writes)
    c = req("c", [50, 51, 52, 53, 54])
    cache.admit(c)
    cache.extend(c, 5)
    cache.release(c)  # its writes go with its row
    assert cache.take_staged() == []
    with pytest.raises(AssertionError, match="KV slot twice"):
        check_step_writes([[4, 5], [5]], [])
    with pytest.raises(AssertionError, match="two values into table row 1"):
        check_step_writes([], [(1, 0, [4, 5]), (1, 1, [6])])
