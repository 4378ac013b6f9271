"""The small-batch projection kernel on CUDA: each projection of a layer and the LM head
take it up to their row limits and cuBLAS above them, and both agree with
`F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.common.layers import skinny


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
