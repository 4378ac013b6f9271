"""The small-batch projection kernel (`common/layers/skinny.py`), run by the Triton
interpreter on the CPU, against torch's matmul: batches and sizes that are not multiples of
its blocks, and a row's result that does not depend on the rows beside it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.interpreted import import_triton, interpreted

if (reason := import_triton()) is not None:
    pytest.skip(f"triton cannot be imported ({reason})", allow_module_level=True)

from baton.common.layers import skinny


@pytest.fixture(scope="module", autouse=True)
def interpreted_kernels() -> Iterator[None]:
    with interpreted(skinny.__name__):
        yield


@pytest.mark.parametrize(
    ("m", "n", "k", "block_n", "block_k"),
    [(1, 40, 96, 16, 32), (3, 64, 64, 32, 64), (17, 33, 80, 16, 32), (8, 16, 200, 16, 64)],
)
def test_matches_torch(m: int, n: int, k: int, block_n: int, block_k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    y = skinny.skinny_linear(x, w, block_n=block_n, block_k=block_k)
    assert y.shape == (m, n)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)


def test_a_row_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen)
    alone = skinny.skinny_linear(x[2:3], w, block_n=16, block_k=32)
    batched = skinny.skinny_linear(x, w, block_n=16, block_k=32)
    assert torch.equal(alone[0], batched[2])


def _rmsnorm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize(("m", "n", "block_n"), [(1, 64, 16), (5, 40, 16), (17, 96, 32)])
def test_a_projection_adds_to_the_stream_and_the_next_applies_its_norm(
    m: int, n: int, block_n: int
) -> None:
    """o_proj (or down) adds its product to the residual stream and sums the new rows'
    squares; the projection after it reads the stream with the norm applied, so the pair
    computes what a norm kernel between two projections does."""
    gen = torch.Generator().manual_seed(m * 100 + n)
    k, n2 = 48, 24
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    w2 = torch.randn(n2, n, generator=gen)
    gain = torch.rand(n, generator=gen) + 0.5
    stream = torch.randn(m, n, generator=gen)
    expected_stream = stream + x @ w.T

    parts = skinny.skinny_add(x, w, stream, block_n=block_n, block_k=32)

    torch.testing.assert_close(stream, expected_stream, rtol=1e-4, atol=1e-4)
    assert parts.shape == (m, -(-n // block_n)) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(1), expected_stream.pow(2).sum(1), rtol=1e-4, atol=1e-3)
    normed = skinny.Normed(stream, parts, gain, 1e-5)
    y = skinny.skinny_linear(normed, w2, block_n=16, block_k=32)
    torch.testing.assert_close(
        y, _rmsnorm(expected_stream, gain, 1e-5) @ w2.T, rtol=1e-4, atol=1e-4
    )


def test_a_stream_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="residual"):
        skinny.skinny_add(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(2, 5))


def test_mismatched_inner_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="columns"):
        skinny.skinny_linear(torch.zeros(1, 8), torch.zeros(4, 9))


def test_a_projection_takes_its_device_s_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    h100 = (skinny.Skinny(32, 64, 256, 4, 4),)
    h200 = (skinny.Skinny(1, 32, 256, 4, 3), skinny.Skinny(32, 64, 256, 4, 4))
    projection = skinny.Projection(h100, (("H200", h200),))
    names = {"cuda:0": "NVIDIA H200", "cuda:1": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(skinny, "device_name", lambda device: names[str(device)])
    assert projection.on(torch.device("cuda:0")) == h200
    assert projection.on(torch.device("cuda:1")) == h100
    assert projection.max_rows == 32  # past every device's last tier, F.linear
