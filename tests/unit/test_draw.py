"""The GPU's sampling kernels (`common/layers/draw.py`), run by the Triton interpreter on the
CPU: what top-k, top-p and min-p keep, against the sorting reference; draws that follow the
distribution; and a row's token that depends on its seed, not on the batch around it."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.layers import argmax, draw
from baton.common.layers.sampler import _filtered_probs


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    with interpreted(argmax.__name__, draw.__name__):
        yield


def filters(
    rows: int,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 11,
) -> draw.Filters:
    """The same settings on every row, each row with a seed of its own."""
    return draw.Filters(
        temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), top_p),
        min_p=torch.full((rows,), min_p),
        seed=torch.arange(rows, dtype=torch.int64) * 7919 + seed,
        k_max=max(top_k, 0),
        any_top_p=top_p < 1,
        any_min_p=min_p > 0,
    )


def kept_by_sorting(row: torch.Tensor, f: draw.Filters) -> set[int]:
    """The tokens the torch path's sort-based filters leave a chance."""
    one = draw.Filters(*(t[:1] if isinstance(t, torch.Tensor) else t for t in f))
    return set(_filtered_probs(row[None].clone(), one)[0].nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "settings",
    [
        {"top_p": 0.63 - 1e-4},  # the cut falls just before the fourth token ...
        {"top_p": 0.63 + 1e-4},  # ... and just after it
        {"top_k": 2},
        {"min_p": 0.8},  # the fifth token falls under 0.8 of the first
        {"temperature": 0.5, "top_k": 4, "top_p": 0.5},  # top-p cuts inside the top 4
    ],
)
def test_the_filters_keep_what_sorting_keeps(settings: dict[str, float]) -> None:
    # five likely tokens (0.22, 0.21, 0.20, 0.19, 0.16 of the mass) among 3,000 unlikely
    # ones: every kept token is likely enough that 32 seeds draw each (the interpreter
    # runs every row's top-p rounds in Python, seconds a row)
    mass = torch.full((3005,), 0.02 / 3000)
    mass[[700, 3, 2999, 41, 1500]] = torch.tensor([0.22, 0.21, 0.20, 0.19, 0.16])
    row = mass.log()
    rows = 32
    f = filters(rows, **settings)  # type: ignore[arg-type]
    drawn = set(draw.draw(row.repeat(rows, 1), f).tolist())
    assert drawn == kept_by_sorting(row, f)


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.5])
    rows = 600
    tokens = draw.draw(probs.log().repeat(rows, 1), filters(rows))
    counts = Counter(tokens.tolist())
    for token, p in enumerate(probs.tolist()):
        sd = math.sqrt(rows * p * (1 - p))
        assert abs(counts[token] - rows * p) < 4 * sd, (token, counts[token], rows * p)


def test_temperature_sharpens_the_draw() -> None:
    probs = torch.tensor([0.3, 0.7])
    rows = 100  # at temperature 1, some 30 of them would draw token 0
    cold = draw.draw(probs.log().repeat(rows, 1), filters(rows, temperature=0.1))
    assert cold.float().mean() > 0.99  # (0.7/0.3)**10: token 1 all but always


def test_a_rows_token_is_its_seeds_alone_or_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * 2
    f = draw.Filters(
        temperature=torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 0.5]),
        top_k=torch.tensor([-1, 50, -1, 0, 7, -1]),
        top_p=torch.tensor([1.0, 0.9, 0.5, 0.95, 1.0, 0.8]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.1]),
        seed=torch.tensor([5, 6, 7, 8, 9, 2**62 + 3]),
        k_max=50,
        any_top_p=True,
        any_min_p=True,
    )
    together = draw.draw(logits, f).tolist()
    for i in range(6):
        alone = draw.Filters(
            *(t[i : i + 1] if isinstance(t, torch.Tensor) else t for t in f[:5]),
            k_max=max(int(f.top_k[i]), 0),
            any_top_p=bool(f.top_p[i] < 1),
            any_min_p=bool(f.min_p[i] > 0),
        )
        assert draw.draw(logits[i : i + 1], alone).tolist() == [together[i]]
    # another seed draws other tokens
    other = draw.draw(logits, f._replace(seed=f.seed + 1)).tolist()
    assert other != together
