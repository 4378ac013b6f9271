"""Sampling's kernels on CUDA (`common/layers/draw.py`) over the served model's vocabulary:
every drawn token is one the sorting filters keep, a row's token depends on its seed and not
on its batch, and the draw replays inside a CUDA graph with the seeds of each step."""

from __future__ import annotations

import torch

from baton.common.layers.draw import Filters, draw
from baton.common.layers.sampler import _filtered_probs

V = 128256
SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, -1, 1.0, 0.0),
    (0.7, -1, 0.9, 0.0),
    (0.7, 50, 1.0, 0.0),
    (1.0, 40, 0.8, 0.05),
    (1.3, -1, 0.95, 0.0),
    (0.6, -1, 1.0, 0.1),
    (1.0, 1000, 0.5, 0.0),
    (0.8, -1, 0.3, 0.0),
]


def _filters(rows: int, seed: int) -> Filters:
    chosen = [SETTINGS[i % len(SETTINGS)] for i in range(rows)]
    t, k, p, mp = (list(c) for c in zip(*chosen, strict=True))
    dev = "cuda"
    return Filters(
        temperature=torch.tensor(t, device=dev),
        top_k=torch.tensor(k, device=dev),
        top_p=torch.tensor(p, device=dev),
        min_p=torch.tensor(mp, device=dev),
        seed=torch.arange(rows, device=dev) * 1_000_003 + seed,
        k_max=max(k),
        any_top_p=True,
        any_min_p=True,
    )


def _logits(rows: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    # peaked enough that top-p keeps a few hundred tokens, as a model's logits do
    return (torch.randn(rows, V, device="cuda", generator=gen) * 4).bfloat16().float()


def test_every_draw_is_a_token_the_sorting_filters_keep() -> None:
    """bf16 logits tie often: where a sort keeps some of the tokens tied at the top-k or
    top-p cut, the kernels keep them all."""
    rows = 32
    logits = _logits(rows)
    f = _filters(rows, 0)
    by_sort = _filtered_probs(logits.clone(), f) > 0
    s = logits / f.temperature[:, None]
    cut = torch.where(by_sort, s, float("inf")).amin(dim=1, keepdim=True)
    m = s.amax(dim=1, keepdim=True)
    kept = (s >= cut) & ((s - m).exp() >= f.min_p[:, None])
    assert (kept | ~by_sort).all()  # the sort's tokens are all kept
    seen = torch.zeros_like(kept)
    for seed in range(64):
        tokens = draw(logits, f._replace(seed=f.seed + seed))
        assert kept.gather(1, tokens[:, None]).all(), seed
        seen.scatter_(1, tokens[:, None], True)
    # the seeds drew other tokens, where the filters keep more than one
    assert (seen.sum(1) > 1).sum() >= (kept.sum(1) > 1).sum() // 2


def test_a_rows_token_is_its_seeds_alone_or_in_a_batch() -> None:
    rows = 16
    logits = _logits(rows)
    f = _filters(rows, 7)
    together = draw(logits, f).tolist()
    for i in range(rows):
        alone = Filters(*(t[i : i + 1] for t in f[:5]), *f[5:])
        assert draw(logits[i : i + 1], alone).tolist() == [together[i]]


def test_the_draw_replays_in_a_cuda_graph() -> None:
    rows = 8
    logits = _logits(rows)
    f = _filters(rows, 0)
    seeds = f.seed.clone()
    for _ in range(2):  # compile outside the graph
        draw(logits, f._replace(seed=seeds))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draw(logits, f._replace(seed=seeds))
    for step in range(4):
        seeds.copy_(f.seed + step * 17)
        graph.replay()
        assert out.tolist() == draw(logits, f._replace(seed=f.seed + step * 17)).tolist()
