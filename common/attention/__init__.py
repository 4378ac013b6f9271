"""Attention backends behind one interface, created through a registry of lazy factories.

Importing this package imports no torch (the command line reads the registry's names);
the interface and the backends load when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from baton.common.attention.base import AttentionBackend, ForwardBatch
    from baton.common.cache.kv_pool import KVPool

# name -> "module:Class"; imported only when chosen, so flashinfer is optional.
_REGISTRY: dict[str, str] = {
    "torch": "baton.common.attention.torch_backend:TorchBackend",
    "triton": "baton.common.attention.triton_backend:TritonBackend",
    "flashinfer": "baton.common.attention.flashinfer_backend:FlashInferBackend",
}

Factory = Callable[["KVPool", int, int], "AttentionBackend"]

# decode's kernels where only --attention-backend is given and another backend's are faster:
# at 2,048 tokens of context, baton's Triton split-KV kernel made decode steps 0.8-2.5%
# faster than flashinfer's on an H100 and 0.9-3.1% on an H200 at batches 1 to 128, and
# needs no plan per step
# (`gpu_engine --decode-backend`, results/gpu_2026-11-27_s14/)
_DECODE_DEFAULT = {"flashinfer": "triton"}


# backends whose second instance is costly (flashinfer: 256 MiB of workspace, which its
# wrappers share, so one instance cannot plan a mixed step's two halves): alone, their
# mixed steps run every row through the prompt kernel
_ONE_INSTANCE = {"flashinfer"}


def available_backends() -> list[str]:
    return list(_REGISTRY)


def default_decode_backend(name: str) -> str:
    """Decode's attention backend when only `name` is chosen for attention."""
    return _DECODE_DEFAULT.get(name, name)


def create_backend(name: str, pool: KVPool, num_heads: int, head_dim: int) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r} (choose from {available_backends()})")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(pool, num_heads, head_dim)


def create_attention(
    prefill: str, decode: str, pool: KVPool, num_heads: int, head_dim: int
) -> AttentionBackend:
    from baton.common.attention.base import HybridBackend

    p = create_backend(prefill, pool, num_heads, head_dim)
    if decode == prefill and prefill in _ONE_INSTANCE:
        return p
    # a second instance of the same backend where it costs little: a mixed step plans both
    # halves at once (`HybridBackend`)
    return HybridBackend(p, create_backend(decode, pool, num_heads, head_dim))


def __getattr__(name: str) -> Any:
    if name in ("AttentionBackend", "ForwardBatch", "HybridBackend"):
        from baton.common.attention import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionBackend",
    "ForwardBatch",
    "available_backends",
    "create_attention",
    "create_backend",
    "default_decode_backend",
]
