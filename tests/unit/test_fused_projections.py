"""Fused projections: q, k, v are one matmul and gate, up another, filled from the
checkpoint's separate tensors. Each tensor-parallel rank holds its own head slices (checked
here in-process for both ranks of TP=2; tests/integration/test_tensor_parallel.py runs the
ranks), and the strict loader still names a bad tensor by its checkpoint name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.common import distributed
from baton.common.config import ModelConfig
from baton.common.models import build_model
from baton.common.models.loader import CheckpointError, load_weights


def _loaded(path: Path, rank: int = 0, size: int = 1):  # type: ignore[no-untyped-def]
    mc = ModelConfig.from_pretrained(path)
    saved = distributed._group
    distributed._group = distributed.TPGroup(rank=rank, size=size)
    try:
        model = build_model(mc)
        load_weights(model, path)
    finally:
        distributed._group = saved
    return mc, model


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_each_rank_holds_its_own_q_k_v_gate_up_slices(model_factory, arch: str, rank: int) -> None:
    path = model_factory(arch)
    mc, model = _loaded(path, rank, size=2)
    ckpt = load_file(str(path / "model.safetensors"))
    d, i = mc.head_dim, mc.intermediate_size // 2

    def mine(name: str, per_rank: int, dim: int = 0) -> torch.Tensor:
        return ckpt[name].narrow(dim, rank * per_rank, per_rank)

    q_rows, kv_rows = mc.num_heads // 2 * d, mc.num_kv_heads // 2 * d
    for n, layer in enumerate(model.model.layers):
        p = f"model.layers.{n}."
        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("weight", "bias") if mc.attention_bias else ("weight",):
            fused = getattr(attn.qkv_proj, kind)
            parts = [
                mine(f"{p}self_attn.{x}_proj.{kind}", rows)
                for x, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            ]
            assert torch.equal(fused, torch.cat(parts)), f"layer {n} qkv {kind}"
        assert torch.equal(attn.o_proj.weight, mine(f"{p}self_attn.o_proj.weight", q_rows, 1))
        if mc.qk_norm:
            assert torch.equal(attn.q_norm.weight, ckpt[f"{p}self_attn.q_norm.weight"])
            assert torch.equal(attn.k_norm.weight, ckpt[f"{p}self_attn.k_norm.weight"])
        gate_up = torch.cat(
            [mine(f"{p}mlp.gate_proj.weight", i), mine(f"{p}mlp.up_proj.weight", i)]
        )
        assert torch.equal(mlp.gate_up_proj.weight, gate_up), f"layer {n} gate_up"
        assert torch.equal(mlp.down_proj.weight, mine(f"{p}mlp.down_proj.weight", i, 1))


def _cut_rows(t: torch.Tensor) -> torch.Tensor:
    return t[:-1].contiguous()


def _cut_columns(t: torch.Tensor) -> torch.Tensor:
    return t[:, :-1].contiguous()


# (family, checkpoint tensor, change: None deletes it)
BAD_TENSORS = [
    ("llama", "model.layers.0.self_attn.q_proj.weight", _cut_columns),
    ("llama", "model.layers.1.mlp.gate_proj.weight", _cut_rows),
    ("qwen2", "model.layers.0.self_attn.v_proj.bias", _cut_rows),
    ("qwen2", "model.layers.1.self_attn.k_proj.bias", None),
    ("qwen3", "model.layers.1.self_attn.q_norm.weight", None),
    ("qwen3", "model.layers.0.self_attn.k_norm.weight", _cut_rows),
]


@pytest.mark.parametrize(("arch", "name", "change"), BAD_TENSORS)
def test_a_bad_tensor_of_a_fused_layer_is_named(
    model_factory, tmp_path: Path, arch: str, name: str, change
) -> None:  # type: ignore[no-untyped-def]
    path = model_factory(arch)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    if change is None:
        del tensors[name]
    else:
        tensors[name] = change(tensors[name])
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _loaded(bad)


def test_a_tensor_named_like_our_fused_layer_is_refused(model_factory, tmp_path: Path) -> None:
    """A checkpoint tensor under our fused name is not taken for a slice of q."""
    path = model_factory("qwen2")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(2)  # our name, not HF's
    save_file(tensors, str(extra / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: .*qkv_proj\.weight"):
        _loaded(extra)
