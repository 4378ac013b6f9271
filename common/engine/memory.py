"""How many tokens a worker's KV pool holds.

With `--max-total-tokens` given, that many. Otherwise (`auto`, the default) a GPU worker
sizes its pool from the memory it may use, once its weights are loaded:

    total × --gpu-memory-fraction
      − what this process's tensors hold already (weights, buffers)
      − the req-to-token table
      − activations of the largest prefill step (an estimate from the model's shape, x2)
      − a fixed margin (CUDA context, cuBLAS and attention workspaces, graph pools)
      − the host tier's staging buffer (64 MiB, with --host-kv-tokens)
      = KV bytes, never more than the memory free right now less the same reserves

and every tensor-parallel rank takes the smallest count of any rank. A CPU worker keeps
`CPU_POOL_TOKENS`. A decode worker whose pool held 32k tokens admitted about 20 requests
of 1,500 tokens at a time on an 80 GB GPU that had room for 400k (issue #38).
"""

from __future__ import annotations

import gc
import logging

import torch

from baton.common.cache.kv_pool import KVPool
from baton.common.cache.page_moves import staging_bytes
from baton.common.config import EngineConfig, ModelConfig
from baton.common.distributed import tp

log = logging.getLogger(__name__)

CPU_POOL_TOKENS = 32768
FIXED_MARGIN_BYTES = 2 << 30
GIB = float(1 << 30)
MIN_AUTO_TOKENS = 4096  # fewer: the fraction or the reserves are wrong, say so


class PoolTooSmall(RuntimeError):
    """The memory left for the KV pool holds too few tokens to serve."""


def kv_bytes_per_token(model_cfg: ModelConfig, cfg: EngineConfig, kv_heads: int) -> int:
    """Bytes one token takes in this rank's pool, and in rank 0's full-head wire buffer
    where a prefill or decode worker runs tensor-parallel (`distributed.wire`)."""
    g = tp()
    if g.size > 1 and g.rank == 0 and cfg.role != "both":
        kv_heads += model_cfg.num_kv_heads
    return KVPool.token_bytes(model_cfg.num_layers, kv_heads, model_cfg.head_dim, cfg.torch_dtype)


def activation_bytes(model_cfg: ModelConfig, cfg: EngineConfig) -> int:
    """Twice the tensors alive at once in a prefill step of the largest token budget: the
    residual stream and its norm, q/k/v, attention's output, gate/up and its product, and
    the logits of the sampled rows (float32)."""
    g = tp().size
    tokens = cfg.chunked_prefill_size or cfg.max_prefill_tokens
    heads = (model_cfg.num_heads + 2 * model_cfg.num_kv_heads) // g
    per_token = (
        3 * model_cfg.hidden_size
        + heads * model_cfg.head_dim
        + 3 * model_cfg.intermediate_size // g
    )
    logits = 4 * model_cfg.vocab_size * cfg.max_running_requests
    return 2 * (tokens * per_token * cfg.torch_dtype.itemsize + logits)


def table_bytes(model_cfg: ModelConfig, cfg: EngineConfig) -> int:
    return 8 * (cfg.max_running_requests + 1) * (model_cfg.context_len + 1)


def pool_tokens(
    cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device, kv_heads: int
) -> int:
    """The pool's size in tokens, a whole number of pages (see the module docstring)."""
    if cfg.max_total_tokens is not None:
        return cfg.max_total_tokens
    if device.type != "cuda":
        return CPU_POOL_TOKENS
    gc.collect()  # an earlier engine of this process, garbage in cycles, frees its tensors
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    # blocks this process's allocator caches but no tensor uses (an engine shut down
    # before this one) are this process's to reuse
    free += torch.cuda.memory_reserved(device) - held
    per_token = kv_bytes_per_token(model_cfg, cfg, kv_heads)
    page = cfg.page_size
    reserve = activation_bytes(model_cfg, cfg) + table_bytes(model_cfg, cfg) + FIXED_MARGIN_BYTES
    if cfg.host_kv_tokens:
        reserve += staging_bytes(page * per_token)
    budget = min(total * cfg.gpu_memory_fraction - held, free) - reserve
    tokens = max(int(budget // per_token) // page * page, 0)
    if tp().size > 1:  # the ranks serve one pool layout: the smallest fits them all
        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        tokens = int(tp().all_reduce_min(count).item())
    log.info(
        "KV pool: %d tokens (%.1f GiB); the GPU has %.1f GiB, %.1f GiB free, this worker may "
        "use %.0f%% and holds %.1f GiB; %.1f GiB kept for activations and workspaces",
        tokens,
        tokens * per_token / GIB,
        total / GIB,
        free / GIB,
        100 * cfg.gpu_memory_fraction,
        held / GIB,
        reserve / GIB,
    )
    if tokens < max(MIN_AUTO_TOKENS, page):
        raise PoolTooSmall(
            f"the KV pool would hold {tokens} tokens: {free / GIB:.1f} GiB of the GPU's "
            f"{total / GIB:.1f} GiB are free, this worker may use "
            f"{100 * cfg.gpu_memory_fraction:.0f}% (--gpu-memory-fraction) and holds "
            f"{held / GIB:.1f} GiB; raise the fraction, lower --max-prefill-tokens or "
            "--max-running-requests, or set --max-total-tokens"
        )
    return tokens
