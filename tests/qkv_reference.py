"""The model's unfused path from a fused q/k/v projection to the KV pool, as a reference
for the fused kernel (`layers.kernels.qkv_rope_store`): split, q/k RMSNorm, RoPE, store."""

from __future__ import annotations

import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.layers import kernels
from baton.common.layers.rotary import RotaryEmbedding


def unfused_qkv(
    qkv: torch.Tensor,
    heads: tuple[int, int],
    positions: torch.Tensor,
    rot: RotaryEmbedding,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None,
    pool: KVPool,
    slots: torch.Tensor,
    layer: int = 1,
) -> torch.Tensor:
    """Stores k, v of `layer` into `pool`; returns q [T, Hq, D]. `qkv` is left as it was
    (on CUDA the unfused RoPE rotates in place)."""
    hq, hk = heads
    d = pool.head_dim
    q, k, v = qkv.clone().split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, d)
    if norms is not None:
        qw, kw, eps = norms
        q, k = kernels.rmsnorm(q, qw, eps), kernels.rmsnorm(k, kw, eps)
    q, k = rot(positions, q, k)
    pool.write(layer, slots, k, v)
    return q
