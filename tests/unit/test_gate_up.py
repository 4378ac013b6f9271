"""The MLP's activation: SiLU·mul over either layout of the gate/up projection's output,
and the fused gate/up GEMM (run by Triton's interpreter on the CPU) against the separate
projection and SiLU·mul."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed")

from baton.common.layers import gate_up, kernels


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@pytest.mark.parametrize("on_triton", [False, True], ids=["torch", "triton"])
def test_silu_and_mul_reads_both_layouts(monkeypatch: pytest.MonkeyPatch, on_triton: bool) -> None:
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", on_triton)
    gate, up = torch.randn(7, 256), torch.randn(7, 256)
    want = _silu_mul(gate, up)
    plain = torch.cat([gate, up], -1)
    torch.testing.assert_close(gate_up.silu_and_mul(plain), want, atol=1e-5, rtol=1e-5)
    # blocks of 64 gate columns, each followed by its 64 up columns
    mixed = torch.stack([gate.view(7, 4, 64), up.view(7, 4, 64)], 2).reshape(7, 512)
    torch.testing.assert_close(gate_up.silu_and_mul(mixed, 64), want, atol=1e-5, rtol=1e-5)


def test_interleave_puts_each_gate_block_before_its_up_block() -> None:
    w = torch.arange(8 * 256).view(8 * 2, 128)  # rows 0-7 gate, 8-15 up
    rows = gate_up.interleave(w, 4)[:, 0] // 128
    assert rows.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="multiple"):
        gate_up.interleave(w, 3)


@pytest.mark.parametrize("rows", [5, 40, 130])
def test_fused_gate_up_equals_projection_then_silu_mul(rows: int) -> None:
    """Rows past a tile and a K past a block, fp16 (the interpreter's dot is exact in
    float32, not in bf16): SiLU·mul of the rounded projection, as the separate kernels."""
    n, k = gate_up.BLOCK * 2, 96
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).half()
    w = (torch.randn(2 * n, k, generator=gen) / k**0.5).half()
    got = gate_up.gate_up_silu(x, gate_up.interleave(w), gate_up.Config(64, 32, 2, 4, 2))
    proj = F.linear(x.float(), w.float()).half().float()
    want = _silu_mul(proj[:, :n], proj[:, n:]).half()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_mlp_after_load_interleaves_once_and_computes_the_same(
    monkeypatch: pytest.MonkeyPatch, model_factory
) -> None:  # type: ignore[no-untyped-def]
    """The interleaved layout end to end on the CPU (where `fits_weight` says no, so it is
    forced): the projection on the interleaved weight, then SiLU·mul reading that layout."""
    from baton.common.config import ModelConfig
    from baton.common.layers.norm import RMSNorm
    from baton.common.models import llama

    cfg = ModelConfig.from_pretrained(model_factory("llama", hidden=64, intermediate=256))
    monkeypatch.setattr(llama, "fits_weight", lambda w: True)
    torch.manual_seed(0)
    plain = llama.MLP(cfg)
    for p in plain.parameters():
        p.data.normal_(0.0, 0.1)
    mixed = llama.MLP(cfg)
    mixed.load_state_dict(plain.state_dict())
    mixed.after_load()
    mixed.after_load()  # a second call leaves the layout as it is
    assert mixed.interleaved == gate_up.BLOCK and plain.interleaved == 0
    assert torch.equal(mixed.gate_up_proj.weight, gate_up.interleave(plain.gate_up_proj.weight))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    after = RMSNorm(64, 1e-5)
    mixed_residual, plain_residual = residual.clone(), residual.clone()
    torch.testing.assert_close(
        mixed(x, mixed_residual, after, None), plain(x, plain_residual, after, None)
    )
    torch.testing.assert_close(mixed_residual, plain_residual)
