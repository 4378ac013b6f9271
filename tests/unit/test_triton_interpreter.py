"""The triton attention backend, run on CPU by the Triton interpreter, against the torch one.

Each case builds a KV pool with random contents and scattered pages, a req-to-token table
and a ForwardBatch, runs the torch reference and the triton backend on two copies of the
pool, and compares the outputs and the pools after the store. The end-to-end case checks
that an engine on the triton backend generates the same greedy tokens as on torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.attention.base import AttentionBackend, ForwardBatch, HybridBackend
from baton.common.attention.torch_backend import TorchBackend
from baton.common.cache.kv_pool import KVPool
from baton.common.engine import Engine
from baton.common.sampling import SamplingParams
from tests.conftest import random_prompts, staggered_outputs


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    """Interpreted kernels while this module runs, even if another module compiled them."""
    attention = "baton.common.attention"
    with interpreted(f"{attention}.triton_kernels", f"{attention}.triton_extend"):
        yield


@dataclass
class Case:
    pool: KVPool
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_case(
    page_size: int,
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    prefix_lens: list[int],
    extend_lens: list[int],
    seed: int = 0,
) -> Case:
    """Random pool contents, each request on shuffled (non-contiguous) pages of its own."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 3
    pool = KVPool(num_pages, page_size, 2, hk, head_dim, dtype, "cpu")
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    free_pages = torch.randperm(num_pages, generator=gen).tolist()
    batch_size = len(seq_lens)
    table = torch.zeros(batch_size + 2, max(seq_lens) + 5, dtype=torch.int64)
    rows = torch.randperm(batch_size + 2, generator=gen)[:batch_size]
    out_loc: list[int] = []
    positions: list[int] = []
    for row, seq, prefix in zip(rows.tolist(), seq_lens, prefix_lens, strict=True):
        pages = [free_pages.pop() for _ in range(-(-seq // page_size))]
        slots = [pages[j // page_size] * page_size + j % page_size for j in range(seq)]
        table[row, :seq] = torch.tensor(slots)
        out_loc += slots[prefix:]
        positions += range(prefix, seq)
    tokens = sum(extend_lens)
    # q, k, v as strided views of one projection, as the model hands them over
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64)

    batch = ForwardBatch(
        positions=ints(positions),
        out_cache_loc=ints(out_loc),
        req_slots=rows.clone(),
        seq_lens=ints(seq_lens),
        extend_lens=ints(extend_lens),
        prefix_lens=ints(prefix_lens),
        req_to_token=table,
        seq_lens_list=seq_lens,
        extend_lens_list=list(extend_lens),
        prefix_lens_list=list(prefix_lens),
    )
    return Case(
        pool,
        batch,
        q.view(tokens, hq, head_dim),
        k.view(tokens, hk, head_dim),
        v.view(tokens, hk, head_dim),
    )


def run_both(
    case: Case, layer: int = 1, make: Callable[..., AttentionBackend] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(triton output, torch output); also asserts both stored the new k, v identically.
    `make(pool, heads, head_dim)`: the backend under test (the triton backend)."""
    from baton.common.attention.triton_backend import TritonBackend

    p = case.pool
    ref_pool = KVPool(
        p.num_pages, p.page_size, p.num_layers, p.num_kv_heads, p.head_dim, p.dtype, "cpu"
    )
    ref_pool.buffer.copy_(p.buffer)
    hq, dim = case.q.shape[1], case.q.shape[2]
    ref = TorchBackend(ref_pool, hq, dim)
    ref.prepare(case.batch)
    expected = ref.forward(case.q, case.k, case.v, layer, case.batch)
    backend = (make or TritonBackend)(p, hq, dim)
    backend.prepare(case.batch)
    got = backend.forward(case.q, case.k, case.v, layer, case.batch)
    assert torch.equal(p.buffer, ref_pool.buffer), "k, v stored at the wrong slots"
    assert got.shape == expected.shape and got.dtype == case.q.dtype
    return got, expected


# (prefix_lens, extend_lens): a batch mixing cached prefixes, a fresh prompt and a 1-token
# extend, and a batch of fresh prompts only.
EXTEND_BATCHES = {
    "prefixed": ([0, 23, 150], [41, 1, 70]),
    "fresh": ([0, 0], [37, 64]),
}
DECODE_PREFIXES = [0, 36, 299, 7]  # context lengths 1, 37, 300, 8

PAGE_SIZES = [1, 3, 16]
HEADS = [(4, 4), (8, 2)]  # GQA ratios 1 and 4


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa4"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_float32_matches_torch(
    page_size: int, heads: tuple[int, int], head_dim: int
) -> None:
    case = make_case(page_size, heads, head_dim, torch.float32, DECODE_PREFIXES, [1] * 4)
    got, expected = run_both(case)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa4"])
@pytest.mark.parametrize("batch", list(EXTEND_BATCHES))
def test_extend_float32_matches_torch(page_size: int, heads: tuple[int, int], batch: str) -> None:
    prefix_lens, extend_lens = EXTEND_BATCHES[batch]
    head_dim = 64 if page_size == 3 else 32
    case = make_case(page_size, heads, head_dim, torch.float32, prefix_lens, extend_lens)
    got, expected = run_both(case)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_mixed_step_is_split_between_prefill_and_decode_kernels(page_size: int) -> None:
    """A mixed step (prompt chunks, then running requests' one-token rows: what
    --enable-mixed-chunk and a decode worker's own prompts schedule) through the hybrid
    backend: the chunks by the prefill backend, the one-token rows by the triton decode
    kernel, the output as the reference computes the whole step at once."""
    from baton.common.attention.triton_backend import TritonBackend

    def hybrid(pool: KVPool, heads: int, head_dim: int) -> AttentionBackend:
        return HybridBackend(
            TorchBackend(pool, heads, head_dim), TritonBackend(pool, heads, head_dim)
        )

    prefix_lens, extend_lens = [0, 40, 299, 36, 7], [37, 25, 1, 1, 1]
    case = make_case(page_size, (8, 2), 32, torch.float32, prefix_lens, extend_lens)
    got, expected = run_both(case, make=hybrid)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [3, 16])
def test_half_precision_matches_torch(dtype: torch.dtype, page_size: int) -> None:
    decode = make_case(page_size, (8, 2), 64, dtype, DECODE_PREFIXES, [1] * 4, seed=1)
    got, expected = run_both(decode)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    prefix_lens, extend_lens = EXTEND_BATCHES["prefixed"]
    extend = make_case(page_size, (8, 2), 64, dtype, prefix_lens, extend_lens, seed=2)
    got, expected = run_both(extend)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_head_dim_not_a_power_of_two() -> None:
    """head_dim 48 is padded to 64 inside the kernels; the padding must not leak."""
    decode = make_case(5, (6, 2), 48, torch.float32, [10, 90], [1, 1])
    got, expected = run_both(decode)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    extend = make_case(5, (6, 2), 48, torch.float32, [10, 0], [20, 33])
    got, expected = run_both(extend)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_split_decode_merges_uneven_splits() -> None:
    """A long context split across programs next to a 1-token one (whose later splits are
    empty) must still equal the unsplit answer."""
    from baton.common.attention.triton_backend import TritonBackend

    case = make_case(3, (8, 2), 32, torch.float32, [299, 0, 130], [1, 1, 1])
    backend = TritonBackend(case.pool, 8, 32)
    assert backend.num_decode_splits(3, 300) > 1
    got, expected = run_both(case)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_unsplit_decode_writes_the_output_itself() -> None:
    """Requests short enough for one split each: the partial kernel writes the answer and
    no reduce runs; it must still be the reference's."""
    from baton.common.attention.triton_backend import TritonBackend

    case = make_case(4, (8, 2), 32, torch.float32, [20, 0, 7], [1, 1, 1])
    assert TritonBackend(case.pool, 8, 32).num_decode_splits(3, 21) == 1
    got, expected = run_both(case)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lens", [[7], [0, 36, 299, 7]], ids=["short", "mixed"])
def test_graph_plan_answers_for_any_context(lens: list[int]) -> None:
    """A decode graph's plan is made once per padded batch size, before any context is
    known: its split count comes from the batch size alone (a short context then leaves
    most splits empty), it keeps its scratch across replays, and the kernels read the
    graph's int64 lengths as they are. Each replay must still give the reference's answer."""
    from baton.common.attention.triton_backend import TritonBackend, _DecodePlan

    case = make_case(4, (8, 2), 32, torch.float32, lens, [1] * len(lens))
    _, expected = run_both(case)  # also stores this step's k, v in the pool
    backend = TritonBackend(case.pool, 8, 32)
    scratch = set()
    for _ in range(2):  # the capture's plan, then a replay's
        backend.prepare_graph(len(lens), case.batch, max_pages=0)
        plan = backend._plan
        assert isinstance(plan, _DecodePlan)
        assert plan.part_lse.shape[2] == backend.num_decode_splits(len(lens)) > 1
        scratch.add(plan.part_out.data_ptr())
        got = backend.attend(case.q, 1, case.batch)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert len(scratch) == 1, "a graph's scratch moved between replays"


def test_engine_greedy_tokens_match_torch_backend(tiny_model: Path) -> None:
    """Prefill, decode, and a second round that hits the radix cache (extend with prefix)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    shared = random_prompts([24], vocab=2000, seed=11)[0]
    first = random_prompts([1, 9, 70], vocab=2000, seed=5)
    second = random_prompts([5, 30], vocab=2000, seed=6, prefix=shared)
    tokens = {}
    for backend in ("torch", "triton"):
        opts = dict(attention_backend=backend, page_size=4, max_total_tokens=1024)
        with Engine(tiny_model, **opts) as engine:
            outs = engine.generate([*first, shared], greedy) + engine.generate(second, greedy)
            tokens[backend] = [o.output_ids for o in outs]
            assert outs[-1].cached_tokens > 0, "the second round should reuse cached pages"
    assert tokens["triton"] == tokens["torch"]


def test_engine_mixed_steps_on_a_hybrid_backend_match_torch(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--enable-mixed-chunk with decode on its own kernels (the default on GPUs: flashinfer
    prompts, triton decode): the split steps give the greedy tokens of the torch backend."""
    split_steps = []
    prepare = HybridBackend.prepare

    def counting(self: HybridBackend, batch: ForwardBatch) -> None:
        prepare(self, batch)
        if self._split is not None:
            split_steps.append(batch.extend_lens_list)

    monkeypatch.setattr(HybridBackend, "prepare", counting)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    prompts = random_prompts([40, 9, 70, 33], vocab=2000, seed=17)
    tokens = {}
    for decode in ("torch", "triton"):
        opts = dict(
            attention_backend="torch",
            decode_attention_backend=decode,
            enable_mixed_chunk=True,
            chunked_prefill_size=16,
            page_size=4,
            max_total_tokens=1024,
        )
        with Engine(tiny_model, **opts) as engine:
            tokens[decode] = staggered_outputs(engine, prompts, greedy)
            assert engine.all_pages_free()
    assert split_steps, "no step mixed prompt chunks with decode rows"
    assert tokens["triton"] == tokens["torch"]
