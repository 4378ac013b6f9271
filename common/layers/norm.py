from __future__ import annotations

import torch
from torch import nn

from baton.common.layers.kernels import rmsnorm


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Llama/Qwen reference implementations do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With `residual`: normalizes x + residual and updates `residual` to that sum."""
        return rmsnorm(x, self.weight, self.eps, residual)
