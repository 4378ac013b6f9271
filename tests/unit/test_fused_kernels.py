"""The fused Triton kernels (run by Triton's interpreter on the CPU) against torch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from baton.common.layers import kernels
from baton.common.layers.rotary import RotaryEmbedding
from tests.qkv_reference import unfused_qkv


@pytest.fixture
def triton_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)  # what BATON_TRITON_CPU=1 sets


def _both(fn, *args):  # type: ignore[no-untyped-def]
    """(torch result, triton result) of fn on copies of args."""
    kernels.TRITON_ON_CPU = False
    ref = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    kernels.TRITON_ON_CPU = True
    try:
        out = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    finally:
        kernels.TRITON_ON_CPU = False
    return ref, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_and_without_residual(dtype: torch.dtype) -> None:
    x = torch.randn(5, 96).to(dtype)
    res = torch.randn(5, 96).to(dtype)
    w = (1 + 0.1 * torch.randn(96)).to(dtype)

    def plain(x, w):  # type: ignore[no-untyped-def]
        return kernels.rmsnorm(x, w, 1e-5)

    def fused(x, r, w):  # type: ignore[no-untyped-def]
        return kernels.rmsnorm(x, w, 1e-5, r), r

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref, out = _both(plain, x, w)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    (ref_y, ref_r), (out_y, out_r) = _both(fused, x, res, w)
    torch.testing.assert_close(out_r, ref_r, atol=tol, rtol=tol)
    torch.testing.assert_close(out_y, ref_y, atol=tol, rtol=tol)


def test_rope_matches_torch_on_strided_views() -> None:
    rot = RotaryEmbedding(32, 256, 10000.0, None)
    qkv = torch.randn(6, (4 + 2 + 2) * 32)
    pos = torch.tensor([0, 1, 5, 77, 200, 3])

    def apply(qkv):  # type: ignore[no-untyped-def]
        q = qkv[:, : 4 * 32].view(6, 4, 32)
        k = qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
        q2, k2 = rot(pos, q, k)
        return q2.clone(), k2.clone()

    (rq, rk), (oq, ok) = _both(apply, qkv)
    torch.testing.assert_close(oq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, rk, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_kv_store_into_page_major_pool(page_size: int) -> None:
    from baton.common.cache.kv_pool import KVPool

    def store(buf_seed):  # type: ignore[no-untyped-def]
        pool = KVPool(8, page_size, 3, 2, 16, torch.float32, "cpu")
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
        slots = torch.tensor([0, 7, page_size * 5 + 1, 2, page_size * 8 - 1]) % (8 * page_size)
        pool.write(1, slots, k, v)
        return pool.buffer

    ref, out = _both(store, torch.tensor(0))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
@pytest.mark.parametrize(("page_size", "heads"), [(1, (4, 4)), (3, (8, 2)), (16, (28, 4))])
def test_qkv_rope_store_matches_the_unfused_path(
    dtype: torch.dtype, qk_norm: bool, page_size: int, heads: tuple[int, int]
) -> None:
    from baton.common.cache.kv_pool import KVPool

    hq, hk = heads
    d, t = 32, 5
    g = torch.Generator().manual_seed(page_size)
    rot = RotaryEmbedding(d, 512, 10000.0, None)
    # a fused projection's output as the model hands it over: rows wider than q, k, v (a
    # bias-free view into a larger buffer) exercise the row stride
    wide = torch.randn(t, (hq + 2 * hk) * d + 8, generator=g).to(dtype)
    qkv = wide[:, : (hq + 2 * hk) * d]
    positions = torch.tensor([0, 7, 300, 2, 511])
    slots = torch.randperm(9 * page_size, generator=g)[:t]  # scattered, each once
    norms = None
    if qk_norm:
        norms = ((1 + 0.3 * torch.randn(d, generator=g)).to(dtype), torch.rand(d).to(dtype), 1e-6)
    pools = [KVPool(9, page_size, 3, hk, d, dtype, "cpu") for _ in range(2)]
    for p in pools:
        p.buffer.copy_(torch.randn(p.buffer.shape, generator=g).to(dtype))
    pools[1].buffer.copy_(pools[0].buffer)
    want = unfused_qkv(qkv, heads, positions, rot, norms, pools[0], slots)
    kernels.TRITON_ON_CPU = True
    try:
        got = kernels.qkv_rope_store(
            qkv, heads, positions, (rot.cos, rot.sin), norms, pools[1].layer_kv(1), slots
        )
    finally:
        kernels.TRITON_ON_CPU = False
    assert got is not None and got.is_contiguous() and got.shape == (t, hq, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, atol=tol, rtol=tol)
    if dtype == torch.float32 and not qk_norm:  # the same float ops in the same order
        assert torch.equal(got, want) and torch.equal(pools[1].buffer, pools[0].buffer)


def test_qkv_rope_store_can_leave_the_rotated_k_in_its_row() -> None:
    """A ragged prefill attends to this step's k and v in the projection's output: with
    `keep_k` the k columns hold what the pool received, and q and v are untouched."""
    from baton.common.cache.kv_pool import KVPool

    hq, hk, d, t = 8, 2, 32, 5
    g = torch.Generator().manual_seed(3)
    rot = RotaryEmbedding(d, 512, 10000.0, None)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    before = qkv.clone()
    positions = torch.tensor([0, 7, 300, 2, 511])
    slots = torch.tensor([4, 0, 9, 2, 5])
    pool = KVPool(4, 4, 3, hk, d, torch.float32, "cpu")
    kernels.TRITON_ON_CPU = True
    try:
        q = kernels.qkv_rope_store(
            qkv, (hq, hk), positions, (rot.cos, rot.sin), None, pool.layer_kv(1), slots, True
        )
    finally:
        kernels.TRITON_ON_CPU = False
    assert q is not None
    stored = pool.layer_kv(1)[slots // 4, 0, slots % 4]  # [T, Hk, D]
    assert torch.equal(qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), stored)
    assert not torch.equal(stored, before[:, hq * d : (hq + hk) * d].view(t, hk, d))
    assert torch.equal(qkv[:, : hq * d], before[:, : hq * d])
    assert torch.equal(qkv[:, (hq + hk) * d :], before[:, (hq + hk) * d :])


def test_qkv_rope_store_declines_without_triton_or_odd_head_dim(triton_cpu: None) -> None:
    from baton.common.cache.kv_pool import KVPool

    rot = RotaryEmbedding(24, 64, 10000.0, None)
    pool = KVPool(4, 1, 1, 1, 24, torch.float32, "cpu")
    qkv = torch.randn(2, 3 * 24)
    args = ((1, 1), torch.tensor([0, 1]), (rot.cos, rot.sin), None, pool.layer_kv(0))
    assert kernels.qkv_rope_store(qkv, *args, torch.tensor([0, 1])) is None  # half of 24: 12
    kernels.TRITON_ON_CPU = False
    rot = RotaryEmbedding(32, 64, 10000.0, None)
    pool = KVPool(4, 1, 1, 1, 32, torch.float32, "cpu")
    args = ((1, 1), torch.tensor([0, 1]), (rot.cos, rot.sin), None, pool.layer_kv(0))
    assert kernels.qkv_rope_store(torch.randn(2, 96), *args, torch.tensor([0, 1])) is None


def test_engine_on_the_fused_kernels_matches_transformers(
    model_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fused kernel in the loop (interpreted): prefill, decode, page size 4, on Qwen3
    (q/k norms, a head_dim that is not hidden / heads)."""
    from baton.common.engine import Engine
    from baton.common.models import llama
    from baton.common.sampling import SamplingParams
    from tests.conftest import hf_greedy, random_prompts

    fused_calls = []

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        q = kernels.qkv_rope_store(*args, **kw)
        fused_calls.append(q is not None)
        return q

    monkeypatch.setattr(llama, "qkv_rope_store", counted)
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)  # what BATON_TRITON_CPU=1 sets
    model = model_factory("qwen3")
    prompts = random_prompts([3, 11], vocab=2000, seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    with Engine(model, page_size=4, max_total_tokens=1024) as engine:
        outs = engine.generate(prompts, params)
    assert fused_calls and all(fused_calls)
    assert [o.output_ids for o in outs] == [hf_greedy(model, p, 4) for p in prompts]


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_layers_fused_projection_equals_the_unfused_one(keep_kv: bool) -> None:
    """`Attention.project` through the one fused kernel (what a GPU and the piecewise
    graphs run) against the unfused path: the same q, the same k and v stored, and with
    `keep_kv` the same rotated k and v handed to the attention."""
    from baton.common.cache.kv_pool import KVPool
    from baton.common.models.llama import Attention
    from tests.conftest import llama_8b_config

    cfg = llama_8b_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(5)
    attn = Attention(cfg, 0, RotaryEmbedding(16, 512, 10000.0, None))
    for p in attn.parameters():
        p.data.copy_(0.2 * torch.randn(p.shape, generator=g))
    x = torch.randn(5, 64, generator=g)
    positions = torch.tensor([0, 7, 300, 2, 511])
    slots = torch.tensor([4, 0, 9, 2, 5])
    pools = [KVPool(4, 4, 1, 2, 16, torch.float32, "cpu") for _ in range(2)]
    kernels.TRITON_ON_CPU = False
    ref = attn.project(x, positions, slots, pools[0].layer_kv(0), keep_kv)
    assert not ref.stored and ref.k is not None and ref.v is not None
    pools[0].write(0, slots, ref.k, ref.v)  # what the attention's `forward` stores first
    kernels.TRITON_ON_CPU = True
    try:
        got = attn.project(x, positions, slots, pools[1].layer_kv(0), keep_kv)
    finally:
        kernels.TRITON_ON_CPU = False
    assert got.stored
    torch.testing.assert_close(got.q, ref.q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, atol=1e-5, rtol=1e-5)
    if keep_kv:
        assert got.k is not None and got.v is not None
        torch.testing.assert_close(got.k, ref.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v, ref.v, atol=1e-5, rtol=1e-5)
    else:
        assert got.k is None and got.v is None
