"""What a GPU can do, measured: HBM bandwidth (a device copy) and the bf16 matmul rate, the
denominators of the engine's floors (`floors`)."""

from __future__ import annotations

import time

import torch


def measure_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    del x, y
    return 2 * 2 * 1024**3 / dt  # read + write


class Matmuls:
    """bf16 matmuls of 8,192 x 8,192 back to back: the rate a FLOP floor divides by."""

    SIZE = 8192

    def __init__(self) -> None:
        self.a = torch.randn(self.SIZE, self.SIZE, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(self.SIZE, self.SIZE, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.a)

    def rate(self, flops: float) -> float:
        """FLOP/s of as many matmuls as make `flops` (at least one), timed from an idle
        stream."""
        n = max(1, round(flops / (2 * self.SIZE**3)))
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            torch.matmul(self.a, self.b, out=self.out)
        torch.cuda.synchronize()
        return 2 * self.SIZE**3 * n / (time.perf_counter() - t)


def measure_matmul(matmuls: Matmuls) -> float:
    matmuls.rate(3 * 2 * Matmuls.SIZE**3)  # warm-up
    return matmuls.rate(20 * 2 * Matmuls.SIZE**3)
