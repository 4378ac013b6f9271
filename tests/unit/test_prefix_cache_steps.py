"""A step never writes one KV slot or one table cell twice.

A request whose prompt the prefix cache holds whole still computes its last page (the
last token's logits are needed). The cache used to swap that page for the tree's copy
while the step was being scheduled, freeing the request's own, which the step was about
to write; the next request of the same step could be handed it. Two requests' KV then
went to the same slots, and the table got two values for the same cells. On a CPU the
last write wins and hid it; on a GPU which write lands is undefined, and cached prompts
came out as other tokens from one engine to the next (H200, 2026-11-27)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import numpy as np

from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts


def _probe(engine: Engine, seen: list[str]) -> None:
    runner = engine.scheduler.runner
    prepare = runner.prepare

    def checked(sb: Any, table_writes: list[tuple[int, int, Any]]) -> Any:
        slots = np.concatenate([np.asarray(it.kv_slots, dtype=np.int64) for it in sb.items])
        if len(np.unique(slots)) != len(slots):
            seen.append(
                f"KV slots written twice: {[(it.req.rid, len(it.kv_slots)) for it in sb.items]}"
            )
        rows = defaultdict(list)
        for row, start, values in table_writes:
            rows[row].append((start, start + len(values)))
        for row, spans in rows.items():
            spans.sort()
            if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
                seen.append(f"table row {row} written twice: {spans}")
        return prepare(sb, table_writes)

    runner.prepare = checked  # type: ignore[method-assign]


def test_cached_prompts_never_share_a_steps_slots(tiny_model) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts([3, 40, 120, 7, 9, 11, 13], vocab=200, seed=6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    with Engine(tiny_model, page_size=4) as fresh:
        expected = [o.output_ids for o in fresh.generate(prompts[:3], greedy)]
    problems: list[str] = []
    with Engine(tiny_model, page_size=4) as engine:
        _probe(engine, problems)
        engine.generate(prompts, greedy)  # every prompt and its answer in the tree
        engine.generate(prompts[:1], SamplingParams(temperature=0.7, seed=1, max_new_tokens=24))
        # two equal answers: the second one's pages are the tree's copies when it ends,
        # and the rows it gives up must take no table write with them into the next step
        engine.generate([prompts[3]] * 2, greedy)
        got = engine.generate(prompts[:3], greedy)
        engine.check_integrity()
    assert not problems, problems
    assert all(o.cached_tokens > 0 for o in got[1:])
    assert [o.output_ids for o in got] == expected
