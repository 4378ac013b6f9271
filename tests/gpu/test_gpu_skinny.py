"""The small-batch projection kernel on CUDA: the row- and column-parallel projections and
the LM head take it up to their row limits and cuBLAS above them, and both agree with
`F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.common.layers import skinny


@pytest.mark.parametrize(
    "how",
    [skinny.ROW_PARALLEL, skinny.COLUMN_PARALLEL, skinny.LM_HEAD],
    ids=["row", "column", "lm_head"],
)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 32, 33])
def test_small_batches_take_the_kernel_and_agree_with_cublas(how: skinny.Skinny, rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    got = skinny.small_batch_linear(x, w, how)
    cublas = F.linear(x, w)
    if rows <= how.max_rows:
        blocks = (how.block_n, how.block_k, how.num_warps, how.num_stages)
        assert torch.equal(got, skinny.skinny_linear(x, w, *blocks))
    else:  # past the limit the kernel's blocks may not even fit in shared memory
        assert torch.equal(got, cublas)
    torch.testing.assert_close(got.float(), cublas.float(), rtol=2e-2, atol=2e-2)
