"""The KV pool's size: given, or sized from the GPU's memory (`engine.memory`).

A decode worker whose pool kept the CPU default of 32k tokens on an 80 GB GPU admitted
about 20 requests of 1,500 tokens at once while the GPU had room for 400k tokens: these
tests pin the arithmetic on an 8B shape with the GPU's answers faked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.common.config import EngineConfig
from baton.common.engine import memory
from tests.conftest import llama_8b_config

GIB = 1 << 30
CUDA = torch.device("cuda")

LLAMA_8B = llama_8b_config()


def engine(**opts: object) -> EngineConfig:
    base = {"model_path": "m8b", "dtype": "bfloat16", "device": "cuda", "page_size": 16}
    return EngineConfig(**{**base, **opts})  # type: ignore[arg-type]


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """An 80 GB GPU on which this process's tensors hold `held` bytes, its allocator caches
    `cached` more, and `free` are free."""
    state = {"total": 80 * GIB, "free": 64 * GIB, "held": 15 * GIB, "cached": 0}
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"])
    )
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["held"])
    monkeypatch.setattr(
        torch.cuda, "memory_reserved", lambda device=None: state["held"] + state["cached"]
    )
    return state


def test_an_8b_decode_worker_gets_the_gpu_not_32k_tokens(gpu) -> None:  # type: ignore[no-untyped-def]
    tokens = memory.pool_tokens(engine(role="decode"), LLAMA_8B, CUDA, kv_heads=8)
    per_token = 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert per_token == memory.kv_bytes_per_token(LLAMA_8B, engine(), 8)
    assert 350_000 < tokens < 450_000, tokens  # ~50 GiB of KV
    assert tokens % 16 == 0
    # the weights, the pool and the reserves stay within the fraction of the GPU
    reserve = memory.activation_bytes(LLAMA_8B, engine()) + memory.FIXED_MARGIN_BYTES
    assert gpu["held"] + tokens * per_token + reserve <= 0.88 * gpu["total"]


def test_workers_that_share_a_gpu_split_it_by_their_fractions(gpu) -> None:  # type: ignore[no-untyped-def]
    whole = memory.pool_tokens(engine(), LLAMA_8B, CUDA, kv_heads=8)
    half = memory.pool_tokens(engine(gpu_memory_fraction=0.44), LLAMA_8B, CUDA, kv_heads=8)
    assert half < whole / 2
    gpu["free"] = 20 * GIB  # another process took the rest: never more than is free
    squeezed = memory.pool_tokens(engine(), LLAMA_8B, CUDA, kv_heads=8)
    assert squeezed * memory.kv_bytes_per_token(LLAMA_8B, engine(), 8) < 20 * GIB


def test_a_given_size_wins_and_a_cpu_worker_keeps_its_default(gpu) -> None:  # type: ignore[no-untyped-def]
    assert memory.pool_tokens(engine(max_total_tokens=4096), LLAMA_8B, CUDA, 8) == 4096
    cpu = dataclasses.replace(engine(), device="cpu")
    assert memory.pool_tokens(cpu, LLAMA_8B, torch.device("cpu"), 8) == memory.CPU_POOL_TOKENS


def test_too_little_memory_says_which_flags_to_change(gpu) -> None:  # type: ignore[no-untyped-def]
    gpu["free"] = 3 * GIB
    with pytest.raises(memory.PoolTooSmall, match=r"--gpu-memory-fraction.*--max-total-tokens"):
        memory.pool_tokens(engine(), LLAMA_8B, CUDA, kv_heads=8)


def test_auto_and_the_fraction_on_the_command_line() -> None:
    from baton.common.options import pool_size

    assert pool_size("auto") is None and pool_size("0") is None and pool_size("8192") == 8192
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        engine(gpu_memory_fraction=0)


def test_memory_an_earlier_engine_left_cached_counts_as_free(gpu) -> None:  # type: ignore[no-untyped-def]
    """A second engine in one process (the GPU tests build several): the first one's
    blocks stay in torch's cache, and are this process's to reuse."""
    first = memory.pool_tokens(engine(), LLAMA_8B, CUDA, kv_heads=8)
    gpu.update(free=2 * GIB, cached=62 * GIB)
    assert memory.pool_tokens(engine(), LLAMA_8B, CUDA, kv_heads=8) == first
