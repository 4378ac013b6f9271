"""The GPU benchmark's floors: the bytes a decode step must read, the FLOPs of a prefill.

Checked twice: by hand on a small config, and against the parameters of the model baton
actually builds (so a floor cannot drift from the model it is a floor for).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.benchmarks.lab.floors import decode_read_bytes, kv_bytes_per_token, prefill_flops
from baton.common import distributed
from baton.common.cache.kv_pool import KVPool
from baton.common.config import ModelConfig
from baton.common.models import build_model

SMALL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}


def test_decode_floor_by_hand() -> None:
    # per layer: q,k,v 8*(2+1+1)*4 = 128, o 2*4*8 = 64, gate/up/down 3*8*16 = 384, norms 16
    # = 592; 2 layers + final norm 8 + LM head 32*8 = 1448; 3 gathered embedding rows 24
    # -> 1472 weights, 2 bytes each; KV: 2 (k, v) * 2 layers * 1 head * 4 * 2 bytes = 32 a token
    assert kv_bytes_per_token(SMALL) == 32
    assert decode_read_bytes(SMALL, batch=3, kv_tokens=10) == 1472 * 2 + 10 * 32
    # the embedding table is never read whole: a larger vocabulary adds only LM-head rows
    bigger = {**SMALL, "vocab_size": 64}
    assert decode_read_bytes(bigger, 3, 10) - decode_read_bytes(SMALL, 3, 10) == 32 * 8 * 2
    # tied: the LM head reads the table, and the gathered rows are part of it
    tied = {**SMALL, "tie_word_embeddings": True}
    assert decode_read_bytes(tied, 3, 10) == (1472 - 24) * 2 + 10 * 32


def test_prefill_flops_by_hand() -> None:
    # 2 FLOPs * 2 layers * 576 projection weights * 5 tokens = 11,520; causal attention
    # 2 (QK^T, PV) * 2 * 2 layers * 2 heads * 4 * 25 / 2 = 800; LM head, one row: 2 * 32 * 8
    assert prefill_flops(SMALL, 5) == 11_520 + 800 + 512


def _model_config(tmp_path: Path, cfg: dict[str, Any]) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_pretrained(tmp_path)


def _read_params(mc: ModelConfig, batch: int) -> int:
    """Parameters one rank's model holds, less the embedding table, plus `batch` rows."""
    with torch.device("meta"):
        model = build_model(mc)
    total = sum(p.numel() for p in model.parameters())  # a tied table is listed once
    if not mc.tie_word_embeddings:
        total += batch * mc.hidden_size - model.model.embed_tokens.weight.numel()
    return total


FAMILIES = {
    "llama": SMALL,
    "llama-tied": {**SMALL, "tie_word_embeddings": True},
    "qwen2-bias": {**SMALL, "architectures": ["Qwen2ForCausalLM"]},
    "qwen3-qk-norm": {**SMALL, "architectures": ["Qwen3ForCausalLM"], "vocab_size": 33},
}


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_floor_counts_the_models_own_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, tp_size: int
) -> None:
    cfg = {**FAMILIES[family], "num_key_value_heads": 2}  # two KV heads: one per rank
    mc = _model_config(tmp_path, cfg)
    monkeypatch.setattr(distributed, "_group", distributed.TPGroup(rank=0, size=tp_size))
    assert decode_read_bytes(cfg, 3, 0, dtype_bytes=1, tp=tp_size) == _read_params(mc, 3)
    kv_heads = mc.num_kv_heads // tp_size
    pool = KVPool(1, 1, mc.num_layers, kv_heads, mc.head_dim, torch.bfloat16, "cpu")
    assert kv_bytes_per_token(cfg, dtype_bytes=2, tp=tp_size) == pool.page_bytes
