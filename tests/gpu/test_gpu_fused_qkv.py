"""The fused q/k/v kernel compiled for the GPU against the unfused kernels it replaced."""

from __future__ import annotations

import pytest
import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.layers import kernels
from baton.common.layers.rotary import RotaryEmbedding
from tests.qkv_reference import unfused_qkv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-norms"])
@pytest.mark.parametrize(("t", "heads", "d"), [(1, (32, 8), 128), (300, (16, 2), 64)])
def test_fused_qkv_matches_the_unfused_kernels(
    dtype: torch.dtype, qk_norm: bool, t: int, heads: tuple[int, int], d: int
) -> None:
    dev = torch.device("cuda")
    hq, hk = heads
    g = torch.Generator(device="cpu").manual_seed(t)
    rot = RotaryEmbedding(d, 4096, 500000.0, None).to(dev)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dev, dtype)
    positions = torch.randint(0, 4096, (t,), generator=g).to(dev)
    slots = torch.randperm(64 * 16, generator=g)[:t].to(dev)
    norms = None
    if qk_norm:
        w = (1 + 0.3 * torch.randn(2, d, generator=g)).to(dev, dtype)
        norms = (w[0], w[1], 1e-6)
    pools = [KVPool(64, 16, 2, hk, d, dtype, dev) for _ in range(2)]
    want = unfused_qkv(qkv, heads, positions, rot, norms, pools[0], slots)
    got = kernels.qkv_rope_store(
        qkv, heads, positions, (rot.cos, rot.sin), norms, pools[1].layer_kv(1), slots
    )
    assert got is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, atol=tol, rtol=tol)
