"""HybridBackend hands CUDA-graph work to the right half: decode graphs to the decode
backend, a prompt's graph to the prefill backend, and attends with whichever it chose."""

from __future__ import annotations

from typing import Any

import torch

from baton.common.attention.base import AttentionBackend, HybridBackend
from baton.common.cache.kv_pool import KVPool


class Recorder(AttentionBackend):
    """Records the calls it gets; `graphs` and `single` say what it supports."""

    def __init__(self, pool: KVPool, name: str, graphs: bool, single: bool) -> None:
        super().__init__(pool, 4, 8)
        self.name, self.graphs, self.single = name, graphs, single
        self.calls: list[tuple[Any, ...]] = []

    def prepare(self, batch: Any) -> None:
        self.calls.append(("prepare",))

    def attend(self, q: torch.Tensor, layer: int, batch: Any, new_kv: Any = None) -> torch.Tensor:
        self.calls.append(("attend", layer))
        return q

    def supports_cuda_graph(self) -> bool:
        return self.graphs

    def prepare_graph(self, bs: int, batch: Any, max_pages: int) -> None:
        self.calls.append(("prepare_graph", bs))

    def prepare_single_prompt(self) -> bool:
        self.calls.append(("single",))
        return self.single


def _pair(
    decode_graphs: bool = True, single: bool = True
) -> tuple[HybridBackend, Recorder, Recorder]:
    pool = KVPool(4, 2, 1, 2, 8, torch.float32, "cpu")
    prefill = Recorder(pool, "prefill", graphs=False, single=single)
    decode = Recorder(pool, "decode", graphs=decode_graphs, single=False)
    return HybridBackend(prefill, decode), prefill, decode


def test_decode_graphs_are_the_decode_backends() -> None:
    hybrid, prefill, decode = _pair()
    assert hybrid.supports_cuda_graph()
    assert not _pair(decode_graphs=False)[0].supports_cuda_graph()
    hybrid.prepare_graph(8, None, 0)
    hybrid.attend(torch.zeros(1), 3, None)
    assert decode.calls == [("prepare_graph", 8), ("attend", 3)]
    assert prefill.calls == []


def test_a_prompts_graph_is_the_prefill_backends() -> None:
    hybrid, prefill, decode = _pair()
    hybrid.prepare_graph(8, None, 0)  # a decode graph first: the prompt's must switch back
    assert hybrid.prepare_single_prompt()
    hybrid.attend(torch.zeros(1), 0, None)
    assert prefill.calls == [("single",), ("attend", 0)]
    assert decode.calls == [("prepare_graph", 8)]


def test_no_prompt_graph_where_prefill_has_none() -> None:
    hybrid, prefill, decode = _pair(single=False)
    hybrid.prepare_graph(2, None, 0)
    assert not hybrid.prepare_single_prompt()
    hybrid.attend(torch.zeros(1), 1, None)  # still the decode backend's, as chosen last
    assert prefill.calls == [("single",)]
    assert decode.calls == [("prepare_graph", 2), ("attend", 1)]
