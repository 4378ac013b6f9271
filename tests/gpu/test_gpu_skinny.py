"""The small-batch projection kernel on CUDA: each projection of a layer and the LM head
take it up to their row limits and cuBLAS above them, and both agree with
`F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.common.layers import skinny
from baton.common.layers.kernels import rmsnorm


@pytest.mark.parametrize(
    "projection",
    [skinny.QKV, skinny.O_PROJ, skinny.GATE_UP, skinny.DOWN, skinny.LM_HEAD],
    ids=["qkv", "o_proj", "gate_up", "down", "lm_head"],
)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 32, 33])
def test_small_batches_take_the_kernel_and_agree_with_cublas(
    projection: skinny.Projection, rows: int
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    got = skinny.small_batch_linear(x, w, projection)
    tiers = projection.on(x.device)
    cublas = F.linear(x, w)
    how = next((how for how in tiers if rows <= how.max_rows), None)
    if how is not None:  # the first tier that holds the rows
        blocks = (how.block_n, how.block_k, how.num_warps, how.num_stages)
        assert torch.equal(got, skinny.skinny_linear(x, w, *blocks))
    else:  # past the limit the kernel's blocks may not even fit in shared memory
        assert torch.equal(got, cublas)
    torch.testing.assert_close(got.float(), cublas.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 8, 16, 33])
def test_the_input_norm_runs_inside_the_projections_around_it(rows: int) -> None:
    """The down projection adding to the residual stream and q/k/v applying the next
    layer's input norm as it reads give what the norm kernel between them gives, to bf16
    rounding (the sums of squares are added in another order); past the kernel's rows
    nothing is fused."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(rows, 14336, generator=gen, **bf16)
    w_down = torch.randn(4096, 14336, generator=gen, **bf16) * 0.01
    w_qkv = torch.randn(6144, 4096, generator=gen, **bf16) * 0.02
    gain = torch.rand(4096, generator=gen, **bf16) + 0.5
    stream = torch.randn(rows, 4096, generator=gen, **bf16)
    stream_ref = stream.clone()

    normed = skinny.small_batch_add_norm(x, w_down, skinny.DOWN, stream, (gain, 1e-5))
    expected = rmsnorm(skinny.small_batch_linear(x, w_down, skinny.DOWN), gain, 1e-5, stream_ref)
    if rows > skinny.DOWN.max_rows:
        assert normed is None
        return
    assert normed is not None
    assert torch.equal(stream, stream_ref)  # the same bf16 sums
    assert torch.equal(normed.applied(), expected)
    got = skinny.small_batch_linear(normed, w_qkv, skinny.QKV)
    want = skinny.small_batch_linear(expected, w_qkv, skinny.QKV)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
