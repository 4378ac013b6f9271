"""Greedy sampling's argmax kernels (`common/layers/argmax.py`), run by the Triton
interpreter on the CPU, against torch's `argmax`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.layers import argmax, kernels


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    with interpreted(argmax.__name__):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_first_maximum(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a vocabulary of several of the kernel's blocks, with ties inside a block and
    across blocks (torch's answer is the first), a row of -inf, and a sliced batch."""
    x = torch.randn(5, 9000).to(dtype)
    x[1, [7000, 5000, 8999]] = 50.0  # tie across blocks
    x[2, [4097, 4100]] = 50.0  # tie inside a block
    x[3] = float("-inf")
    x[4, 8999] = 50.0  # the last, in the short last block
    ref = x[1:].argmax(dim=-1)
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)  # the kernels, interpreted
    out = argmax.argmax_rows(x[1:])
    assert out.tolist() == ref.tolist() == [5000, 4097, 0, 8999]
    assert out.dtype == torch.int64
