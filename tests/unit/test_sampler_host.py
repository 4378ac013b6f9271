"""The sampler's host contract: it never reads a device value on the host (on a GPU that
would wait for the forward pass in flight), a batch of plain greedy rows costs one
argmax, and a row's token does not depend on the batch around it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from baton.common.layers.graph_draw import GRAPH_TOP_K, DrawKind, graph_draw, graph_filters
from baton.common.layers.penalties import PenaltyState
from baton.common.layers.sampler import SamplingRow, _Knobs, sample
from baton.common.sampling import SamplingParams

V = 500
KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logit_bias={5: 30.0, 7: -100.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={3: 4.0},
    ),
    SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=0.0, top_k=1, logit_bias={9: 2.0}),
]


def _rows(rng: random.Random, n: int) -> list[SamplingRow]:
    rows = []
    for j in range(n):
        p = rng.choice(KINDS)
        penalty = PenaltyState([1, 2, 3, 5], [7, 7, 11], V, torch.device("cpu"))
        block = [5, 9] if rng.random() < 0.3 else []
        rows.append(
            SamplingRow(p, rng.getrandbits(40), j, block, penalty if p.uses_penalties else None)
        )
    return rows


def _fresh(row: SamplingRow) -> SamplingRow:
    """The same row with its own copy of the penalty state (sampling updates it)."""
    if row.penalty is None:
        return row
    penalty = PenaltyState([], [], V, torch.device("cpu"))
    penalty.seen, penalty.counts = row.penalty.seen.clone(), row.penalty.counts.clone()
    return SamplingRow(row.params, row.seed, row.position, row.block_stop, penalty)


_HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy"}


class _NoHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        assert name not in _HOST_READS, f"sample() read a tensor on the host ({name})"
        return func(*args, **(kwargs or {}))


def test_sampling_reads_nothing_back_from_the_device() -> None:
    rng = random.Random(0)
    for n in (1, 4, 9):
        rows = _rows(rng, n)
        logits = torch.randn(n, V) * 3
        with _NoHostReads():
            result = sample(logits, rows)
        assert result.tokens.shape == (n,)


def test_a_rows_token_is_the_same_alone_or_in_any_batch() -> None:
    """Bias, stop-token masks, penalties, filters and seeded draws are applied per row."""
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(2, 9)
        rows = _rows(rng, n)
        logits = torch.randn(n, V) * 3
        alone = [sample(logits[i : i + 1], [_fresh(r)]) for i, r in enumerate(rows)]
        together = sample(logits, [_fresh(r) for r in rows])
        assert together.tokens.tolist() == [a.tokens.item() for a in alone]
        if together.logprobs is not None:
            for i, a in enumerate(alone):
                if a.logprobs is not None:
                    torch.testing.assert_close(together.logprobs[i], a.logprobs[0])


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting() -> Iterator[_Ops]:
    with _Ops() as ops:
        yield ops


def test_a_plain_greedy_batch_is_one_argmax() -> None:
    logits = torch.randn(128, V)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, 3, [], None) for _ in range(128)]
    with _counting() as ops:
        result = sample(logits, rows)
    assert ops.ops == ["aten.argmax"]
    assert torch.equal(result.tokens, logits.argmax(-1)) and result.logprobs is None
    # anything to apply first takes the general path, with the same answer where it applies
    rows[5] = SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), 0, 3, [], None)
    tokens: Any = sample(logits, rows).tokens
    assert tokens[5] == 3 and torch.equal(tokens[:5], logits[:5].argmax(-1))


def test_a_step_that_only_draws_takes_the_graph_with_the_samplers_settings() -> None:
    """A decode graph draws a step whose rows only filter and draw (`graph_draw`), with the
    settings the sampler itself would use (`graph_filters` reads the graph's columns
    back), greedy rows beside them; any row with more to do keeps the step eager."""
    rows = [
        SamplingRow(p, 100 + i, 7 + i, [], None)
        for i, p in enumerate(
            [
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.7, top_p=0.9),
                SamplingParams(temperature=1.0, top_k=50, min_p=0.05),
                SamplingParams(temperature=0.5, top_k=1),  # greedy
                SamplingParams(temperature=1.3, top_k=-1),
            ]
        )
    ]
    plan = graph_draw(rows)
    assert plan is not None
    kind, columns = plan
    assert kind == DrawKind(k_max=64, top_p=True, min_p=True)
    greedy, filters = graph_filters(torch.tensor(np.stack(columns)), kind)
    assert greedy.tolist() == [True, False, False, True, False]
    knobs = _Knobs.of(rows, torch.device("cpu"))
    drawn = knobs.sampled_list
    assert drawn == [1, 2, 4]
    for name in ("temperature", "top_p", "min_p", "seed"):
        assert torch.equal(getattr(filters, name)[drawn], getattr(knobs.filters, name)), name
    assert filters.top_k[drawn].tolist() == [0, 50, 0]
    assert graph_draw([rows[0], rows[3]]) is None  # all greedy: the forward's argmax
    assert graph_draw([*rows, SamplingRow(KINDS[1], 1, 0, [], None)]) is None  # a bias
    assert graph_draw([*rows, SamplingRow(KINDS[8], 1, 0, [], None)]) is None  # logprobs
    assert graph_draw([*rows, SamplingRow(KINDS[3], 1, 0, [9], None)]) is None  # stop mask
    huge = SamplingParams(temperature=1.0, top_k=GRAPH_TOP_K + 1)
    assert graph_draw([*rows, SamplingRow(huge, 1, 0, [], None)]) is None
