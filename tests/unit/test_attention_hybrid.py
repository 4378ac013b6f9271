"""HybridBackend hands CUDA-graph work to the right half: decode graphs to the decode
backend, a prompt's graph to the prefill backend, and attends with whichever it chose; a
mixed step's prompt rows go to the prefill backend and its one-token rows to the decode
backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from baton.common.attention.base import AttentionBackend, ForwardBatch, HybridBackend
from baton.common.cache.kv_pool import KVPool


class Recorder(AttentionBackend):
    """Records the calls it gets; `graphs` and `single` say what it supports."""

    def __init__(self, pool: KVPool, name: str, graphs: bool, single: bool) -> None:
        super().__init__(pool, 4, 8)
        self.name, self.graphs, self.single = name, graphs, single
        self.calls: list[tuple[Any, ...]] = []

    def prepare(self, batch: Any) -> None:
        self.calls.append(("prepare",) if batch is None else ("prepare", batch.extend_lens_list))

    def attend(self, q: torch.Tensor, layer: int, batch: Any, new_kv: Any = None) -> torch.Tensor:
        self.calls.append(
            ("attend", layer) if new_kv is None else ("attend", layer, len(new_kv[0]))
        )
        return q + (100 if self.name == "decode" else 0)

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


def _batch(prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    tokens = sum(extend_lens)
    return ForwardBatch(
        positions=torch.arange(tokens),
        out_cache_loc=torch.arange(tokens),
        req_slots=torch.arange(len(seq_lens)),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        prefix_lens=torch.tensor(prefix_lens),
        req_to_token=torch.zeros(len(seq_lens), 64, dtype=torch.int64),
        seq_lens_list=seq_lens,
        extend_lens_list=extend_lens,
        prefix_lens_list=prefix_lens,
    )


def test_a_mixed_step_sends_its_one_token_rows_to_the_decode_backend() -> None:
    hybrid, prefill, decode = _pair()
    batch = _batch([0, 12, 30, 9, 4], [5, 3, 1, 1, 1])  # two prompt chunks, three decodes
    hybrid.prepare(batch)
    assert hybrid.reads_table(batch)
    q = torch.arange(11.0)
    new_kv = (torch.zeros(11), torch.zeros(11))
    out = hybrid.attend(q, 2, batch, new_kv)
    assert prefill.calls == [("prepare", [5, 3]), ("attend", 2, 8)]
    assert decode.calls == [("prepare", [1, 1, 1]), ("attend", 2, 3)]
    assert out.tolist() == [*range(8), 108.0, 109.0, 110.0]  # in the step's row order


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "who"),
    [([9, 4], [1, 1], "decode"), ([0, 3], [5, 7], "prefill"), ([2, 0], [1, 6], "prefill")],
    ids=["decode-only", "prompts-only", "one-token-row-first"],
)
def test_a_step_of_one_kind_is_not_split(
    prefix_lens: list[int], extend_lens: list[int], who: str
) -> None:
    hybrid, prefill, decode = _pair()
    hybrid.prepare(_batch(prefix_lens, extend_lens))
    hybrid.attend(torch.zeros(sum(extend_lens)), 0, None)
    chosen, other = (decode, prefill) if who == "decode" else (prefill, decode)
    assert chosen.calls == [("prepare", extend_lens), ("attend", 0)]
    assert other.calls == []
