"""The penalty kernels (`common/layers/penalties.py`), run by the Triton interpreter on the
CPU, against the sampler's torch path: the same penalized logits, and each row's sampled
token counted in that row's own statistics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.layers import penalties
from baton.common.layers.penalties import PenaltyState
from baton.common.layers.sampler import SamplingRow, _apply_penalties, _Knobs
from baton.common.sampling import SamplingParams

V = 5000
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    with interpreted(penalties.__name__):
        yield


def _rows() -> list[SamplingRow]:
    kinds = [
        SamplingParams(temperature=0.7, repetition_penalty=1.3),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, presence_penalty=-1.0),
    ]
    rows = []
    for i, p in enumerate(kinds):
        state = PenaltyState([1, 2, 4999], [7, 7, 40 + i], V, CPU) if p.uses_penalties else None
        rows.append(SamplingRow(p, i, 3, [], state))
    return rows


def test_the_kernels_penalize_and_count_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen) * 3
    rows = _rows()
    knobs = _Knobs.of(rows, CPU)
    expected = logits.clone()
    _apply_penalties(expected, knobs)  # torch's path: no Triton on the CPU
    got = logits.clone()
    penalties.penalize(
        got,
        knobs.penalty_rows,
        knobs.seen_at,
        knobs.counts_at,
        (knobs.repetition, knobs.frequency, knobs.presence),
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])

    tokens = torch.tensor([11, 12, 7, 4999])
    penalties.count(tokens, knobs.penalty_rows, knobs.seen_at, knobs.counts_at)
    for i, token in ((0, 11), (2, 7), (3, 4999)):
        state = rows[i].penalty
        assert state is not None
        assert state.seen[token] and state.counts[token] == (3 if token == 7 else 1)
    assert rows[0].penalty is not None and rows[0].penalty.counts.sum() == 4
