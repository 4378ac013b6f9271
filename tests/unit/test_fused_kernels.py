"""The fused Triton kernels (run by Triton's interpreter on the CPU) against torch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from baton.common.layers import kernels
from baton.common.layers.rotary import RotaryEmbedding


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


def test_silu_and_mul() -> None:
    x = torch.randn(7, 2 * 300)
    ref, out = _both(kernels.silu_and_mul, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


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
