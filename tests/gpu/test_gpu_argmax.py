"""Greedy sampling's argmax kernel on CUDA gives torch's token for every row: the first
index of the maximum, over the served model's vocabulary, ties included."""

from __future__ import annotations

import pytest
import torch

from baton.common.layers.argmax import argmax_rows


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
def test_argmax_rows_matches_torch(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    # bf16 logits widened to float32, as the LM head's: ties are common at this precision
    logits = torch.randn(rows, 128256, device="cuda", generator=gen).bfloat16().float()
    logits[0, [90000, 4096, 128255]] = 100.0  # a tie across blocks: the first wins
    if rows > 2:
        logits[2] = float("-inf")
    got = argmax_rows(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[0].item() == 4096
